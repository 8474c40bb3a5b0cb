"""trl_ext.runtime: the thread default respects explicit settings; bf16 is enabled only where it is ours to enable."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import trl

from trl_ext import runtime
from trl_ext.runtime import ThreadSetting, thread_setting


# ------------------------------------------------------------------------------------------------- thread setting
def test_unset_is_not_explicit():
    assert thread_setting(env={}, launcher_env={}, launcher_cmdline=[]) == ThreadSetting(False, "unset", None)


def test_accelerate_default_is_not_explicit():
    # accelerate launch (no config, no GPU) exported OMP_NUM_THREADS=1; the launcher itself was started without it
    setting = thread_setting(
        env={"OMP_NUM_THREADS": "1"},
        launcher_env={"PATH": "/usr/bin"},
        launcher_cmdline=[".venv/bin/python", ".venv/bin/accelerate", "launch", "recipes/grpo_math.py"],
    )
    assert setting == ThreadSetting(False, "launcher default", 1)


def test_exported_before_launch_is_explicit():
    setting = thread_setting(
        env={"OMP_NUM_THREADS": "1"},
        launcher_env={"OMP_NUM_THREADS": "1"},
        launcher_cmdline=["accelerate", "launch", "x.py"],
    )
    assert setting == ThreadSetting(True, "OMP_NUM_THREADS", 1)


@pytest.mark.parametrize("flag", [["--num_cpu_threads_per_process", "3"], ["--num_cpu_threads_per_process=3"]])
def test_launcher_flag_is_explicit(flag):
    setting = thread_setting(
        env={"OMP_NUM_THREADS": "3"}, launcher_env={}, launcher_cmdline=["accelerate", "launch", *flag, "x.py"]
    )
    assert setting == ThreadSetting(True, "--num_cpu_threads_per_process", 3)


def test_without_a_launcher_the_variable_is_the_users():
    # no launcher ancestor (plain `python script.py`): nobody but the user can have set it
    assert thread_setting(env={"OMP_NUM_THREADS": "2"}, launcher_env=None, launcher_cmdline=None).explicit


@pytest.mark.parametrize(
    "cmdline, expected",
    [
        (["/x/.venv/bin/python", "/x/.venv/bin/accelerate", "launch", "a.py"], True),
        (["python", "-m", "accelerate.commands.launch", "a.py"], True),
        (["/usr/bin/torchrun", "--nproc_per_node", "2", "a.py"], True),
        (["python", "-m", "torch.distributed.run", "a.py"], True),
        (["uv", "run", "accelerate", "launch", "a.py"], True),  # uv's own process, one level above accelerate
        (["python", "a.py", "launch"], False),
        (["bash", "-c", "accelerate env"], False),
    ],
)
def test_is_launcher(cmdline, expected):
    assert runtime._is_launcher(cmdline) is expected


@pytest.mark.parametrize(
    "local_processes, cores, expected", [(1, 2, 2), (2, 2, 1), (3, 2, 1), (2, 16, 8), (3, 16, 5), (1, 1, 1)]
)
def test_default_num_threads_shares_cores_among_local_processes(local_processes, cores, expected):
    assert runtime.default_num_threads(local_processes, cores) == expected


def test_configure_respects_explicit_and_changes_default(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setattr(runtime, "default_num_threads", lambda: 1 if before != 1 else 2)
    monkeypatch.setenv("OMP_NUM_THREADS", str(before))
    try:
        kept = runtime.configure_cpu_threads(ThreadSetting(True, "OMP_NUM_THREADS", before), on_gpu=False)
        assert kept == {"threads": before, "source": "OMP_NUM_THREADS", "changed": False}
        assert torch.get_num_threads() == before
        target = 1 if before != 1 else 2
        done = runtime.configure_cpu_threads(ThreadSetting(False, "launcher default", before), on_gpu=False)
        assert done == {"threads": target, "source": "default (cores / local processes)", "changed": True}
        assert torch.get_num_threads() == target and os.environ["OMP_NUM_THREADS"] == str(target)
        assert runtime.configure_cpu_threads(ThreadSetting(False, "unset", None), on_gpu=True)["source"] == "gpu"
    finally:
        torch.set_num_threads(before)


_PROBE = textwrap.dedent(
    """
    import json, os, torch
    from trl_ext import runtime
    setting = runtime.thread_setting()
    done = runtime.configure_cpu_threads(setting, on_gpu=False)
    print("PROBE" + json.dumps({"explicit": setting.explicit, "source": setting.source, "env":
    os.environ.get("OMP_NUM_THREADS"),
                                 "threads": torch.get_num_threads(), "cores": runtime.available_cores()}))
    """
)


@pytest.mark.slow
@pytest.mark.parametrize(
    "launch_flags, exported, expect_explicit, expect_source",
    [
        ([], None, False, "launcher default"),
        ([], "1", True, "OMP_NUM_THREADS"),
        (["--num_cpu_threads_per_process", "1"], None, True, "--num_cpu_threads_per_process"),
    ],
)
def test_real_accelerate_launch(tmp_path, launch_flags, exported, expect_explicit, expect_source):
    """The real launcher (no config file, no GPU): its default 1 is replaced, a user's 1 is kept."""
    script = tmp_path / "probe.py"
    script.write_text(_PROBE)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update(CUDA_VISIBLE_DEVICES="", ACCELERATE_CONFIG_FILE=str(tmp_path / "none.yaml"))
    if exported is not None:
        env["OMP_NUM_THREADS"] = exported
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", *launch_flags, str(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    probe = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("PROBE"))[5:])
    assert probe["explicit"] is expect_explicit and probe["source"] == expect_source
    assert probe["threads"] == (1 if expect_explicit else probe["cores"])


# ----------------------------------------------------------------------------------------------------------- bf16
@pytest.mark.parametrize(
    "cpuinfo, expected",
    [
        ("processor\t: 0\nflags\t\t: fpu sse avx512f avx512_bf16 avx512_vnni\n", True),
        ("flags\t\t: fpu sse amx_bf16 amx_tile\n", True),
        ("Features\t: fp asimd bf16 i8mm\n", True),  # Arm
        ("flags\t\t: fpu sse avx2 avx512f avx512bw\n", False),
        ("model name\t: bf16 marketing name\nflags\t\t: fpu sse\n", False),  # only flag lines count
    ],
)
def test_cpu_has_bf16(cpuinfo, expected):
    assert runtime.cpu_has_bf16(cpuinfo) is expected


def test_precision_set_by_user(tmp_path):
    plain, with_bf16 = tmp_path / "a.yaml", tmp_path / "b.yaml"
    plain.write_text("max_steps: 2\n")
    with_bf16.write_text("bf16: false\nmax_steps: 2\n")
    assert not runtime.precision_set_by_user(["--max_steps", "2"], plain)
    assert runtime.precision_set_by_user(["--bf16", "false"], plain)
    assert runtime.precision_set_by_user(["--fp16=true"], plain)
    assert runtime.precision_set_by_user([], with_bf16)
    assert runtime.precision_set_by_user(["--config", str(with_bf16)])
    assert not runtime.precision_set_by_user(["--bf16_full_eval", "true"], plain)
    # every layer counts: the recipe's defaults set it, a --config over them does not mention it (the CPU config
    # says bf16: false; a --config that only adds use_vllm must not turn bf16 autocast on)
    assert runtime.precision_set_by_user(["--config", str(plain)], with_bf16)
    assert runtime.precision_set_by_user([f"--config={plain}", "--config", str(with_bf16)], plain)
    assert not runtime.precision_set_by_user(["--config", str(plain)], plain)


def _args(**kwargs):
    return trl.GRPOConfig(output_dir="/tmp/unused", use_cpu=True, report_to="none", **kwargs)


def test_enable_cpu_bf16_only_when_ours_to_enable():
    args = _args(bf16=False)
    assert runtime.enable_cpu_bf16(args, user_set=False, has_bf16=True).startswith("bf16 autocast")
    assert args.bf16 and args.mixed_precision == "bf16" and args.cast_lm_head_to_fp32
    args = _args()  # TRL's own default bf16=True: on a CPU without bf16 instructions our default is fp32
    assert args.bf16
    assert runtime.enable_cpu_bf16(args, user_set=False, has_bf16=False).startswith("fp32")
    assert not args.bf16 and args.mixed_precision == "no" and not args.cast_lm_head_to_fp32
    args = _args(bf16=False)  # the user said fp32 (e.g. --bf16 false): kept
    assert runtime.enable_cpu_bf16(args, user_set=True, has_bf16=True) == "fp32"
    assert not args.bf16 and not args.cast_lm_head_to_fp32
    args = _args(bf16=True)  # the user said bf16 on a CPU without bf16 instructions: kept
    assert runtime.enable_cpu_bf16(args, user_set=True, has_bf16=False) == "bf16 autocast, fp32 weights" and args.bf16


@pytest.mark.parametrize(
    "bf16, dtype, label",
    [
        (False, "float32", "fp32"),
        (False, None, "checkpoint-dtype weights, no autocast"),  # transformers 5 loads None/"auto" as stored
        (False, "auto", "checkpoint-dtype weights, no autocast"),
        (False, "bfloat16", "bf16 weights, no autocast"),  # dtype: bfloat16 with --bf16 false trains in bf16, not fp32
        (True, "bfloat16", "bf16 autocast, bf16 weights"),
        (True, "float32", "bf16 autocast, fp32 weights"),
        (False, torch.float16, "fp16 weights, no autocast"),
    ],
)
def test_the_precision_label_names_the_weights_dtype_and_the_autocast(bf16, dtype, label):
    args = _args(bf16=bf16)
    assert runtime.precision_label(args, dtype) == label
    assert runtime.enable_cpu_bf16(args, user_set=True, dtype=dtype) == label
    assert runtime.enable_cpu_bf16(_args(bf16=False), user_set=False, has_bf16=False, dtype="bfloat16") == (
        "bf16 weights, no autocast (default: no bf16 instructions)"
    )


@pytest.mark.parametrize(
    "requested, loaded, bf16, label",
    [
        ("auto", torch.bfloat16, False, "bf16 weights, no autocast (GPU)"),  # a bf16 checkpoint such as Qwen2.5-Math
        (None, torch.float32, False, "fp32 (GPU)"),
        ("auto", torch.bfloat16, True, "bf16 autocast, bf16 weights (GPU)"),
        ("bfloat16", torch.bfloat16, False, "bf16 weights, no autocast (GPU)"),  # named already: unchanged
    ],
)
def test_the_loaded_weights_dtype_replaces_checkpoint_dtype(requested, loaded, bf16, label, tiny_model):
    args = _args(bf16=bf16)
    made = runtime.precision_label(args, requested) + " (GPU)"  # as enable_cpu_bf16 labels a GPU run
    model = tiny_model.to(loaded)
    assert runtime.name_loaded_weights(made, args, requested, model) == label
    assert runtime.name_loaded_weights("something else", args, requested, model) == "something else"


class _FakeLibc:
    """A C library's ``mallopt`` that records its calls (glibc's unless ``glibc=False``)."""

    def __init__(self, glibc: bool = True, accepts: bool = True):
        self.calls: list[tuple[int, int]] = []
        self._accepts = accepts
        if glibc:
            self.gnu_get_libc_version = lambda: b"2.36"

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return 1 if self._accepts else 0


_KEPT = [(-3, 32 * 2**20), (-1, -1)]  # mallopt(M_MMAP_THRESHOLD, 32 MiB), mallopt(M_TRIM_THRESHOLD, -1)


@pytest.mark.parametrize(
    "on_gpu, environ, glibc, accepts, expected, calls",
    [
        (False, {}, True, True, "freed memory kept", _KEPT),
        (True, {}, True, True, "glibc default (GPU run)", []),
        (False, {"TRL_EXT_KEEP_FREED_MEMORY": "0"}, True, True, "TRL_EXT_KEEP_FREED_MEMORY=0", []),
        (False, {"TRL_EXT_KEEP_FREED_MEMORY": "off"}, True, True, "TRL_EXT_KEEP_FREED_MEMORY=off", []),
        (False, {"TRL_EXT_KEEP_FREED_MEMORY": "1"}, True, True, "freed memory kept", _KEPT),
        (False, {"MALLOC_TRIM_THRESHOLD_": "131072"}, True, True, "as the user set it (MALLOC_TRIM_THRESHOLD_)", []),
        (False, {"MALLOC_MMAP_MAX_": "0"}, True, True, "as the user set it (MALLOC_MMAP_MAX_)", []),
        (False, {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}, True, True, "(GLIBC_TUNABLES)", []),
        (False, {"GLIBC_TUNABLES": "glibc.pthread.rseq=0"}, True, True, "freed memory kept", _KEPT),
        (False, {}, False, True, "system default (not glibc)", []),
        (False, {}, True, False, "glibc default (mallopt refused)", [(-3, 32 * 2**20)]),
    ],
)
def test_keep_freed_memory_decides_from_the_run_and_the_users_settings(
    on_gpu, environ, glibc, accepts, expected, calls
):
    libc = _FakeLibc(glibc, accepts)
    said = runtime.keep_freed_memory(on_gpu=on_gpu, environ=environ, libc=libc)
    assert expected in said and libc.calls == calls


_FAULTS_SCRIPT = textwrap.dedent(
    """
    import resource, sys, torch
    from trl_ext import runtime
    torch.set_num_threads(2)  # as the main job runs (with one thread this glibc happened to keep the heap's top)
    if sys.argv[1] == "keep":
        print(runtime.keep_freed_memory(on_gpu=False, environ={}), file=sys.stderr)
    def step():  # a step's working set: forty 8 MiB blocks, touched, then all freed
        blocks = [torch.ones(2 * 2**20) for _ in range(40)]
        del blocks
    # by glibc's defaults the first step's blocks are mapped and unmapped one by one (its mmap threshold starts at
    # 128 KiB and rises with each unmapped block), so the next step takes new heap pages and faults every one in;
    # whether later steps reuse the heap is the luck of what small allocation lands above it, so the count is taken
    # on the second step, where it does not depend on that
    step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_a_kept_step_does_not_fault_its_working_set_in_again():
    # 40 x 8 MiB = 320 MiB freed at the end of a step: with glibc's defaults the memory goes back to the system and
    # the next step faults every page in again (81,920 pages of 4 KiB); kept, the next step reuses them
    def faults(mode):
        env = {**os.environ, "OMP_NUM_THREADS": "2"}
        env = {k: v for k, v in env.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
        run = subprocess.run(
            [sys.executable, "-c", _FAULTS_SCRIPT, mode], capture_output=True, text=True, check=True, env=env
        )
        return int(run.stdout.split()[-1])

    pages = 40 * 8 * 2**20 // 4096
    default, kept = faults("default"), faults("keep")
    assert default > pages // 2, default
    # kept: a few blocks may still land on new pages (small allocations between steps move the heap's free space;
    # 1 to 8,192 faults seen), not the whole working set
    assert kept < pages // 5, kept


def test_keep_freed_memory_says_what_holds_when_only_the_trim_setting_is_refused():
    libc = _FakeLibc()
    # accepts M_MMAP_THRESHOLD (-3), refuses M_TRIM_THRESHOLD (-1)
    libc.mallopt = lambda param, value: libc.calls.append((param, value)) or int(param != -1)
    said = runtime.keep_freed_memory(on_gpu=False, environ={}, libc=libc)
    assert libc.calls == _KEPT and said.startswith("blocks under 32 MiB from the heap") and "M_TRIM_THRESHOLD" in said
