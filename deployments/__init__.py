"""Ray Serve and OpenAI HTTP glue over `runtime`: `LLMServer` replicas behind an
`OpenAIIngress`, built by `deployments.app:build_app`."""
