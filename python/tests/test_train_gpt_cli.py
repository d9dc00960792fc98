"""The command line of examples/python/train_gpt.py: --state and --baseline, the names of the
files it writes, and how it counts the bytes of optimizer state. Nothing here trains."""

import importlib.util
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "python" / "train_gpt.py"


@pytest.fixture(scope="module")
def train_gpt():
    name = "_stepfuse_example_train_gpt"
    spec = importlib.util.spec_from_file_location(name, SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(name, None)


def test_defaults_keep_the_default_comparison(train_gpt):
    args = train_gpt.parse_args([])
    assert (args.state, args.baseline) == ("f32", "torch")
    assert train_gpt.variant_suffix(args) == ""  # train_gpt.png / train_gpt.md


@pytest.mark.parametrize("argv, suffix", [
    (["--state", "q8"], "_q8"),
    (["--state", "bf16"], "_bf16"),
    (["--baseline", "torchao-adamw8bit"], "_torchao"),
    (["--state", "q8", "--baseline", "torchao-adamw8bit"], "_q8_torchao"),
    (["--state", "f32", "--baseline", "torch"], ""),
])
def test_other_states_and_baselines_write_other_files(train_gpt, argv, suffix):
    assert train_gpt.variant_suffix(train_gpt.parse_args(argv)) == suffix


@pytest.mark.parametrize("argv", [
    ["--state", "q4"],
    ["--baseline", "bnb"],
    ["--only", "torch", "--state", "q8"],
    ["--only", "stepfuse", "--baseline", "torchao-adamw8bit"],
    ["--stand-in", "--state", "bf16"],
])
def test_contradictory_options_are_refused(train_gpt, argv, capsys):
    with pytest.raises(SystemExit) as e:
        train_gpt.parse_args(argv)
    assert e.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_state_bytes_of_torch_adamw(train_gpt):
    """fp32 exp_avg and exp_avg_sq: 8 bytes per parameter; the step counters are not counted."""
    params = [torch.nn.Parameter(torch.randn(64, 65)), torch.nn.Parameter(torch.randn(10))]
    opt = torch.optim.AdamW(params, lr=1e-3)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    assert train_gpt.state_bytes(opt) == 8 * sum(p.numel() for p in params)


def test_summary_keeps_what_follows_the_marker(train_gpt, tmp_path):
    """A rewrite of train_gpt.md keeps the hand-written sections after the marker line."""
    path = tmp_path / "train_gpt.md"
    path.write_text(f"old generated part\n\n{train_gpt.KEEP_MARKER}\n\n## Another run\n",
                    encoding="utf-8")
    args = train_gpt.parse_args(["--quick"])
    run = train_gpt.Run("A", "A: label", None, None, torch.amp.GradScaler("cpu", enabled=False),
                        None, train_loss=[3.0, 2.0], step_s=[1e-3, 1e-3], eval_steps=[0, 2],
                        eval_loss=[4.0, 3.0])
    corpus = train_gpt.Corpus(["a", "b"], torch.zeros(10, dtype=torch.long),
                              torch.zeros(5, dtype=torch.long))
    train_gpt.write_summary(path, None, [run], args, 100, corpus, ["--quick"], 1.0, "versions", [])
    text = path.read_text(encoding="utf-8")
    assert "old generated part" not in text and "| A: label |" in text
    assert text.endswith(f"{train_gpt.KEEP_MARKER}\n\n## Another run\n")
