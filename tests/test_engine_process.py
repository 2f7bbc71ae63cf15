"""The engine loop in its own process (`AsyncEngine(process=True)`, what `LLMServer`
runs by default): the same outputs and typed errors as the loop on a thread, and no
engine process outlives its server or hangs a caller when it dies. The async tests of
test_errors_and_async.py run on both kinds of loop."""

import asyncio
import os
import resource
import signal
import subprocess
import sys
import textwrap

import pytest

from runtime import AsyncEngine, EngineConfig, SamplingParams
from runtime.errors import EngineDeadError, PromptTooLongError, RequestAbortedError

from .conftest import FD_LIMIT_AT_START
from .serving import ROOT, exited, process_env


@pytest.fixture(scope="module")
def engines(default_model):
    cfg = EngineConfig(model=default_model, num_gpu_blocks=128)
    thread, proc = AsyncEngine(cfg), AsyncEngine(cfg, process=True)
    yield thread, proc
    thread.shutdown()
    proc.shutdown()


async def _collect(eng, i: int, p: SamplingParams):
    outs = [o async for o in eng.generate(f"Question {i}: where do the", p)]
    o = outs[-1].outputs[0]
    return (o.token_ids, "".join(x.outputs[0].delta_text for x in outs),
            [(lp.token_id, round(lp.logprob, 4)) for lp in o.logprobs], outs[-1].num_cached_tokens)


def test_process_engine_gives_the_thread_engines_outputs(engines):
    thread, proc = engines
    assert proc.process and proc.max_model_len == thread.max_model_len
    assert proc.vocab_size == thread.vocab_size
    p = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)

    async def run(eng):
        return await asyncio.gather(*(_collect(eng, i, p) for i in range(6)))

    want, got = asyncio.run(run(thread)), asyncio.run(run(proc))
    assert got == want
    s = proc.stats()
    assert s["requests_finished"] >= 6 and s["num_blocks_held_by_requests"] == 0
    assert proc.tokenizer.encode("Question") == thread.tokenizer.encode("Question")


@pytest.mark.skipif(not os.path.exists("/proc/self/environ"), reason="reads /proc")
def test_the_engine_process_gets_the_variables_it_is_given(default_model):
    eng = AsyncEngine(EngineConfig(model=default_model, num_gpu_blocks=32), process=True,
                      env={"OMP_NUM_THREADS": "3"})
    try:
        assert process_env(eng._core.proc.pid)["OMP_NUM_THREADS"] == "3"
    finally:
        eng.shutdown()
    with pytest.raises(ValueError, match="engine process"):
        AsyncEngine(EngineConfig(model=default_model, num_gpu_blocks=32), env={"OMP_NUM_THREADS": "3"})


def test_process_engine_raises_typed_errors_with_their_fields(engines):
    _, proc = engines

    async def run():
        async for _ in proc.generate(prompt_token_ids=[5] * 10, params=SamplingParams(max_tokens=10**6)):
            pass

    with pytest.raises(PromptTooLongError) as e:
        asyncio.run(run())
    assert e.value.param == "prompt" and e.value.max_model_len == proc.max_model_len
    proc.check_health()


def test_a_dead_engine_process_fails_its_streams_and_health(default_model):
    eng = AsyncEngine(EngineConfig(model=default_model, num_gpu_blocks=64), process=True)
    p = SamplingParams(max_tokens=900, ignore_eos=True)

    async def run():
        got = 0
        async for _ in eng.generate("A long story", p):
            got += 1
            if got == 2:
                os.kill(eng._core.proc.pid, signal.SIGKILL)
        return got

    try:
        with pytest.raises(EngineDeadError, match="exited"):
            asyncio.run(asyncio.wait_for(run(), 60))
        with pytest.raises(EngineDeadError):
            eng.check_health()
    finally:
        eng.shutdown(timeout=5)


def test_shutdown_ends_streams_and_reaps_the_engine_process(default_model):
    eng = AsyncEngine(EngineConfig(model=default_model, num_gpu_blocks=64), process=True)
    pid = eng._core.proc.pid

    async def run():
        agen = eng.generate("Once upon a time", SamplingParams(max_tokens=900, ignore_eos=True))
        await agen.__anext__()
        await asyncio.get_running_loop().run_in_executor(None, eng.shutdown)
        async for _ in agen:
            pass

    with pytest.raises(RequestAbortedError):
        asyncio.run(asyncio.wait_for(run(), 60))
    assert eng._core.proc.poll() is not None and exited(pid, 5)


def test_the_engine_process_never_outlives_its_server(default_model, tmp_path):
    """The server is killed outright (no shutdown, no finalizers): its engine process
    sees its socket close and exits."""
    script = textwrap.dedent(f"""
        import os, signal
        from runtime import AsyncEngine, EngineConfig
        eng = AsyncEngine(EngineConfig(model={default_model!r}, num_gpu_blocks=32), process=True)
        print(eng._core.proc.pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == -signal.SIGKILL, out.stderr[-2000:]
    child = int(out.stdout.split()[0])
    assert exited(child, 30), f"engine process {child} outlived its server"


@pytest.mark.parametrize("process", [False, True], ids=["loop-on-thread", "loop-in-process"])
@pytest.mark.parametrize("shutdown", [True, False], ids=["shut-down", "left-running"])
def test_the_interpreter_exits_cleanly_after_an_engine(default_model, process, shutdown):
    """MLX's streams belong to the thread that made them and must be cleared there: an
    engine thread that left it to interpreter exit aborted the process ("terminate
    called without an active exception", exit 134) in most runs, shut down or not."""
    script = textwrap.dedent(f"""
        import asyncio
        from runtime import AsyncEngine, EngineConfig, SamplingParams
        eng = AsyncEngine(EngineConfig(model={default_model!r}, num_gpu_blocks=32), process={process})
        async def main():
            return [o async for o in eng.generate("hello", SamplingParams(max_tokens=4))][-1]
        print(len(asyncio.run(main()).outputs[0].token_ids), flush=True)
        if {shutdown}:
            eng.shutdown()
    """)
    for _ in range(3):
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0 and out.stdout.split() == ["4"], out.stderr[-2000:]


FD_LIMITS = """
import resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[2]), resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
before = resource.getrlimit(resource.RLIMIT_NOFILE)
__import__(sys.argv[1])
print(*before, *resource.getrlimit(resource.RLIMIT_NOFILE))
"""


@pytest.mark.skipif(FD_LIMIT_AT_START[1] <= 4096, reason="needs a hard file-descriptor limit above mlx-lm's 4096")
def test_importing_the_runtime_never_lowers_the_fd_limit():
    """mlx-lm's import sets RLIMIT_NOFILE to (2048, 4096), lowering a higher limit for
    the process and all it starts (a replica's connections, HAProxy under Serve). Our
    runtime imports it raise-only: this test process (which imported it) kept its
    limit, a higher limit stays, a lower soft one still rises to 2048. The bare mlx-lm
    import shows the test can tell."""
    assert resource.getrlimit(resource.RLIMIT_NOFILE) == FD_LIMIT_AT_START

    def limits(module: str, soft: int) -> list[int]:
        out = subprocess.run([sys.executable, "-c", FD_LIMITS, module, str(soft)], capture_output=True,
                             text=True, check=True, cwd=ROOT).stdout
        return [int(x) for x in out.split()[-4:]]

    soft0, hard0, soft1, hard1 = limits("mlx_lm", 3000)
    assert (soft1, hard1) == (2048, 4096) and hard0 > 4096
    soft0, hard0, soft1, hard1 = limits("runtime", 3000)
    assert (soft1, hard1) == (soft0, hard0) == (3000, hard0)
    _, hard0, soft1, hard1 = limits("runtime", 256)
    assert (soft1, hard1) == (2048, hard0)
