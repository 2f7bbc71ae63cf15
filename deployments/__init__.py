"""Ray Serve and OpenAI HTTP glue over `runtime`: `LLMServer` replicas behind an
`OpenAIIngress`, or both in one `ColocatedServer` replica, built by
`deployments.app:build_app`."""
