"""Every file in accelerate_configs/ goes through accelerate's own loading and launch preparation.

For each config: ``load_config_from_file`` (accelerate's config classes) parses it; then the path ``accelerate launch
--config_file X`` takes is replayed without starting processes -- the launch argument parser, the config-file merge
and validation (``_validate_launch_command``), and the launcher's environment preparation -- and the environment the
training processes would receive is checked. FSDP and DeepSpeed configs are also turned into accelerate's plugin
objects from that environment, as the training processes do. Nothing here needs a GPU or the deepspeed package.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils import DeepSpeedPlugin, DistributedType, FullyShardedDataParallelPlugin, patch_environment
from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env, prepare_simple_launcher_cmd_env

CONFIG_DIR = Path(__file__).resolve().parents[1] / "accelerate_configs"

# name -> (distributed type, processes, mixed precision)
EXPECTED = {
    "single_gpu_lora.yaml": (DistributedType.NO, 1, "bf16"),
    "single_gpu_qlora.yaml": (DistributedType.NO, 1, "bf16"),
    "multi_gpu_ddp.yaml": (DistributedType.MULTI_GPU, 8, "bf16"),
    "multi_gpu_fsdp2.yaml": (DistributedType.FSDP, 8, "bf16"),
    "multi_gpu_full.yaml": (DistributedType.FSDP, 8, "bf16"),
    "deepspeed_zero3.yaml": (DistributedType.DEEPSPEED, 8, "bf16"),
    "cpu_2proc.yaml": (DistributedType.MULTI_GPU, 2, "no"),
    "single_process.yaml": (DistributedType.NO, 1, "no"),
}
# alias -> the file it must be (one config, two names; see the comments in the target files)
ALIASES = {"single_gpu_qlora.yaml": "single_gpu_lora.yaml", "multi_gpu_full.yaml": "multi_gpu_fsdp2.yaml"}


def launch_env(path: Path) -> tuple[object, dict[str, str]]:
    """Replay `accelerate launch --config_file path train.py`: return (merged launch args, training environment)."""
    args = launch_command_parser().parse_args(["--config_file", str(path), "train.py", "--flag", "1"])
    args, defaults, _ = _validate_launch_command(args)
    if args.use_deepspeed:
        # as accelerate.commands.launch.launch_command does before calling the DeepSpeed launcher
        args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)
        _, env = prepare_deepspeed_cmd_env(args)
    elif args.multi_gpu or args.use_fsdp:
        env = prepare_multi_gpu_env(args)  # the torchrun launcher
    else:
        cmd, env = prepare_simple_launcher_cmd_env(args)
        assert cmd[-3:] == ["train.py", "--flag", "1"]
    return args, {k: v for k, v in env.items() if k.startswith(("ACCELERATE_", "FSDP_"))}


def test_every_config_file_is_covered():
    assert sorted(p.name for p in CONFIG_DIR.glob("*.yaml")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_config_loads_and_launch_environment(name):
    path = CONFIG_DIR / name
    distributed_type, num_processes, mixed_precision = EXPECTED[name]
    config = load_config_from_file(str(path))
    assert isinstance(config, ClusterConfig)
    assert config.compute_environment.value == "LOCAL_MACHINE"
    assert config.distributed_type == distributed_type
    assert config.num_processes == num_processes
    assert config.mixed_precision == mixed_precision
    assert config.num_machines == 1

    args, env = launch_env(path)
    assert args.num_processes == num_processes
    assert env["ACCELERATE_MIXED_PRECISION"] == mixed_precision
    if distributed_type == DistributedType.NO:
        assert not (args.multi_gpu or args.use_fsdp or args.use_deepspeed)
        assert env["ACCELERATE_USE_CPU"] == "False"
    else:  # torchrun or the DeepSpeed launcher starts one process per GPU
        assert args.nproc_per_node == str(num_processes)


def test_single_process_config_leaves_accelerate_nothing_to_warn_about(caplog, monkeypatch, tmp_path):
    # accelerate logs "The following values were not passed to `accelerate launch`..." for every value it fills in;
    # the README's main-job command must launch without that warning, and without accelerate's CPU thread heuristic
    # (trl_ext.runtime decides threads), so OMP_NUM_THREADS is accelerate's plain default of 1, marked as not ours.
    with caplog.at_level("WARNING"):
        args, _ = launch_env(CONFIG_DIR / "single_process.yaml")
    assert "were not passed" not in caplog.text
    assert args.num_cpu_threads_per_process == 1 and args.num_processes == 1 and not args.use_cpu
    # while a bare `accelerate launch train.py` (no default config under HF_HOME) does warn
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    caplog.clear()
    with caplog.at_level("WARNING"):
        _validate_launch_command(launch_command_parser().parse_args(["train.py"]))
    assert "were not passed" in caplog.text


def test_cpu_2proc_starts_two_torchrun_processes_on_a_free_port():
    args, env = launch_env(CONFIG_DIR / "cpu_2proc.yaml")
    assert args.multi_gpu and not args.cpu  # the torchrun launcher, not the single-process simple launcher
    assert args.use_cpu is True
    assert args.nproc_per_node == "2"
    assert args.main_process_port > 0  # 0 in the file: accelerate picked a free port
    assert "ACCELERATE_USE_FSDP" not in env and "ACCELERATE_USE_DEEPSPEED" not in env


@pytest.mark.parametrize("name", ["multi_gpu_fsdp2.yaml", "multi_gpu_full.yaml"])
def test_fsdp2_full_finetuning_plugin(name):
    _, env = launch_env(CONFIG_DIR / name)
    assert env["ACCELERATE_USE_FSDP"] == "true"
    assert env["FSDP_VERSION"] == "2"
    with patch_environment(**env):
        plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2
    assert plugin.state_dict_type.name == "FULL_STATE_DICT"  # save_model writes a from_pretrained checkpoint
    assert plugin.reshard_after_forward is True
    assert plugin.cpu_ram_efficient_loading is True
    assert plugin.auto_wrap_policy.__name__ == "transformer_auto_wrap_policy"
    assert plugin.activation_checkpointing is False  # the recipe's gradient_checkpointing does it instead


def test_deepspeed_zero3_plugin_takes_accumulation_from_the_recipe():
    _, env = launch_env(CONFIG_DIR / "deepspeed_zero3.yaml")
    assert env["ACCELERATE_USE_DEEPSPEED"] == "true"
    assert env["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "3"
    assert env["ACCELERATE_DEEPSPEED_ZERO3_INIT"] == "true"
    assert env["ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL"] == "true"
    assert "ACCELERATE_GRADIENT_ACCUMULATION_STEPS" not in env
    with patch_environment(**env):
        plugin = DeepSpeedPlugin()
    assert plugin.zero_stage == 3
    assert plugin.gradient_accumulation_steps == "auto"  # filled from --gradient_accumulation_steps by transformers
    zero = plugin.deepspeed_config["zero_optimization"]
    assert zero["stage"] == 3
    assert zero["offload_optimizer"]["device"] == "none"
    assert zero["stage3_gather_16bit_weights_on_model_save"] is True


@pytest.mark.parametrize("alias", sorted(ALIASES))
def test_aliases_are_relative_symlinks_to_one_file(alias):
    path = CONFIG_DIR / alias
    assert path.is_symlink()
    assert os.readlink(path) == ALIASES[alias]  # relative, so it survives a clone anywhere
    assert path.resolve() == (CONFIG_DIR / ALIASES[alias]).resolve()


# ------------------------------------------------------------------------------------------- launched on CPU
# Each launch config that can start on a CPU machine runs recipes/grpo_math.py for one optimizer step through
# `accelerate launch`, with the recipe flags of the command in the file's own header plus the rehearsal's CPU flags
# (tests/stand_ins.py: allowed_overrides); launcher flag: --num_processes 2 where the file says 8 (one process per GPU).
# config -> (launcher flags, recipe --config, the header's recipe flags, expected processes, expected distributed type)
CPU_LAUNCHES = {
    "single_process.yaml": ([], None, [], 1, "NO"),  # the README's main job, on the CPU defaults
    "single_gpu_lora.yaml": (
        [],
        "grpo_math_gsm8k.yaml",
        ["--use_peft", "--lora_target_modules", "all-linear"],
        1,
        "NO",
    ),
    "multi_gpu_ddp.yaml": (
        ["--num_processes", "2"],
        "grpo_math_gsm8k.yaml",
        ["--use_peft", "--lora_target_modules", "all-linear"],
        2,
        "MULTI_CPU",
    ),
}
LAUNCHED_ELSEWHERE = {"cpu_2proc.yaml": "tests/test_distributed.py, tests/test_distributed_sft.py"}
NOT_ON_CPU = {  # and why (docs/scaling.md says the same)
    "deepspeed_zero3.yaml": "DeepSpeed is in the gpu extra only and needs a CUDA accelerator",
    "multi_gpu_fsdp2.yaml": "accelerate enables FSDP only on GPU-type devices; on CPU it starts but runs plain DDP",
}


def test_every_config_is_launched_on_cpu_or_said_not_to_be():
    # the two aliases are the same files as single_gpu_lora.yaml and multi_gpu_fsdp2.yaml
    assert set(CPU_LAUNCHES) | set(LAUNCHED_ELSEWHERE) | set(NOT_ON_CPU) | set(ALIASES) == set(EXPECTED)
    scaling = (CONFIG_DIR.parent / "docs" / "scaling.md").read_text()
    assert all(name in scaling for name in NOT_ON_CPU)


def test_an_fsdp_launch_on_the_cpu_is_said_to_run_plain_data_parallel(capsys):
    # accelerate's AcceleratorState turns FSDP on only for GPU-type multi-process runs (MULTI_GPU, MULTI_XPU, ...);
    # a CPU run under the FSDP config's launch environment (measured: 2 processes) trains as MULTI_CPU
    from conftest import load_recipe

    _, env = launch_env(CONFIG_DIR / "multi_gpu_fsdp2.yaml")
    grpo_math = load_recipe("grpo_math")
    with patch_environment(**env):
        grpo_math.main.parse_args(["--max_steps", "1"])  # the CPU defaults: use_cpu true
    assert capsys.readouterr().err == (
        "note: accelerate runs FSDP only on GPUs; on the CPU (use_cpu true, or no GPU) this launch trains with plain "
        "data parallelism, every process holding the whole model\n"
    )
    grpo_math.main.parse_args(["--max_steps", "1"])  # no FSDP launch: no note
    assert capsys.readouterr().err == ""


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CPU_LAUNCHES))
def test_config_launches_the_recipe_on_cpu(name, tmp_path, qwen_stand_in, llama_stand_in):
    import json
    import subprocess
    import sys

    import yaml
    from stand_ins import HUB_DATASETS, allowed_overrides, write_jsonl

    launcher, recipe_config, header_flags, processes, distributed = CPU_LAUNCHES[name]
    out = tmp_path / "out"
    if recipe_config is None:
        config, argv = (
            yaml.safe_load((CONFIG_DIR.parent / "recipes" / "configs" / "grpo_math_cpu.yaml").read_text()),
            [],
        )
        flags = allowed_overrides(config, "grpo_math", llama_stand_in, None, out)
    else:
        path = CONFIG_DIR.parent / "recipes" / "configs" / recipe_config
        config, argv = yaml.safe_load(path.read_text()), ["--config", str(path)]
        data = write_jsonl(tmp_path / "data.jsonl", HUB_DATASETS[config["dataset_name"]](40))
        flags = allowed_overrides(config, "grpo_math", qwen_stand_in, str(data), out)
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(CONFIG_DIR / name),
        *launcher,
        str(CONFIG_DIR.parent / "recipes" / "grpo_math.py"),
        *argv,
        *header_flags,
        *flags,
        "--report_to",
        "none",
        "--log_completions",
        "false",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["train_steps"] == 1
    assert metrics["runtime"]["processes"] == processes
    assert metrics["runtime"]["distributed_type"] == f"DistributedType.{distributed}"
    if "--use_peft" in header_flags:  # the LoRA adapter is what was saved
        assert (out / "adapter_config.json").is_file()


@pytest.mark.parametrize(
    "name", ["single_process.yaml", "cpu_2proc.yaml", "multi_gpu_ddp.yaml", "single_gpu_lora.yaml"]
)
def test_the_command_a_launched_run_prints_relaunches_it_without_the_warning(name, caplog, monkeypatch, tmp_path):
    """The command a run records and prints (trl_ext.run.command_line: experiment.md, the resume line) under a launch
    with this config: run through accelerate's own launch parsing with no config file anywhere, it warns of no value
    "not passed" and launches as many processes with the same mixed precision; one process without mixed precision
    is `uv run python`, the same job."""
    import shlex

    from trl_ext.run import command_line

    args, env = launch_env(CONFIG_DIR / name)
    processes = int(args.num_processes)
    for key in [k for k in os.environ if k.startswith("ACCELERATE_")]:
        monkeypatch.delenv(key)
    for key, value in {**env, "WORLD_SIZE": str(processes), "LOCAL_WORLD_SIZE": str(processes)}.items():
        monkeypatch.setenv(key, value)  # what the training processes of that launch see
    command = command_line(["recipes/grpo_math.py", "--max_steps", "2"])
    if processes == 1 and args.mixed_precision == "no":
        assert command == "uv run python recipes/grpo_math.py --max_steps 2"
        return
    words = shlex.split(command)
    assert words[:4] == ["uv", "run", "accelerate", "launch"] and words[-3:] == [
        "recipes/grpo_math.py",
        "--max_steps",
        "2",
    ]
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # no default accelerate config either
    with caplog.at_level("WARNING"):
        relaunched, _, _ = _validate_launch_command(launch_command_parser().parse_args(words[4:]))
    assert "were not passed" not in caplog.text
    assert (relaunched.num_processes, relaunched.mixed_precision) == (processes, args.mixed_precision)
    assert relaunched.multi_gpu == (processes > 1)
