"""TRL's own tests/test_grpo_trainer.py with trl_ext swapped in (issue 39 item 2; docs/upstream_tests.md).

The whole file, run as upstream and swapped, is scripts/upstream_grpo_tests.py's job (not collected by default:
tests/conftest.py ignores tests/upstream_trl unless $TRL_EXT_UPSTREAM_TESTS is 1). Here: that the swap really binds
trl_ext's classes and the Hub ids resolve to the stand-ins (default run), and one of TRL's basic training tests passes
with trl_ext (slow). TRL's test files are not in this repository; the script copies them into tests/upstream_trl/
from a TRL checkout, and without them the slow test skips.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

UPSTREAM = Path(__file__).parent / "upstream_trl"
HAVE_FILES = all((UPSTREAM / name).exists() for name in ("test_grpo_trainer.py", "testing_utils.py"))
needs_files = pytest.mark.skipif(
    not HAVE_FILES, reason="TRL's tests/test_grpo_trainer.py not copied in (scripts/upstream_grpo_tests.py does it)"
)


def _pytest(*args: str, swap: bool) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRL_EXT_UPSTREAM_TESTS="1", TRL_EXT_UPSTREAM_SWAP="1" if swap else "0")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
    return subprocess.run(command, cwd=Path(__file__).parent.parent, env=env, capture_output=True, text=True)


PROBE = """
import trl
import trl_ext
from datasets import load_dataset
from transformers import AutoTokenizer
from trl import GRPOConfig, GRPOTrainer


def test_bound():
    expected = trl_ext if {swap} else trl
    assert GRPOTrainer is expected.GRPOTrainer
    assert GRPOConfig is expected.GRPOConfig


def test_stand_ins():
    tokenizer = AutoTokenizer.from_pretrained("trl-internal-testing/tiny-Qwen2ForCausalLM-2.5")
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id, len(tokenizer)) == (151645, 151643, 151668)
    zen = load_dataset("trl-internal-testing/zen", "standard_prompt_only")
    assert (zen["train"].num_rows, zen["test"].num_rows) == (17, 2)
    assert zen["train"][3] == {{"prompt": "Complex"}}
"""


@pytest.mark.parametrize("swap", [False, True])
def test_conftest_swaps_the_classes_and_resolves_hub_ids(swap):
    """A module of tests/upstream_trl importing ``from trl import GRPOConfig, GRPOTrainer`` sees trl_ext's classes
    with the swap and TRL's without; the Hub ids the TRL file uses resolve to the stand-ins (Qwen2.5's special ids:
    EOS 151645, pad 151643; 151665 + 3 added tokens) and the zen dataset's 17/2 split."""
    probe = UPSTREAM / f"test_probe_{os.getpid()}_{swap}.py"
    probe.write_text(PROBE.format(swap=swap))
    try:
        result = _pytest(str(probe), swap=swap)
    finally:
        probe.unlink()
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "2 passed" in result.stdout


@needs_files
@pytest.mark.slow
def test_trl_basic_training_test_passes_with_trl_ext():
    """TRL's own test_train_loss_types[dapo-False] (17 prompts x 3 completions, 3 epochs, every parameter must
    change) passes with trl_ext's GRPOTrainer and GRPOConfig."""
    test = "upstream_trl/test_grpo_trainer.py::TestGRPOTrainer::test_train_loss_types[dapo-False]"
    result = _pytest(str(Path(__file__).parent / test), swap=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "1 passed" in result.stdout
