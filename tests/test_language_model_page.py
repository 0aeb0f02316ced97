"""docs/language-models.md and examples/language_model.py say the same, print what the page
shows, and what they print is right: checked against each sentence run alone, unpadded,
through the same GPT-2 with hand-written hooks, and NumPy in float64."""

from __future__ import annotations

import re
import runpy
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lightning_iocatch import FeatureStore
from lightning_iocatch.cli import main as command_line

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "language-models.md"
EXAMPLE = ROOT / "examples" / "language_model.py"


def fenced(kind: str) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", PAGE.read_text(), re.S)


def code_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def test_the_example_is_the_pages_blocks_in_order() -> None:
    """Blank lines aside (the formatter's business), the file after its docstring and the
    linter's line is the page's Python blocks, in order."""
    example = EXAMPLE.read_text().split("# ruff: noqa: E402", 1)[1].split("\n", 1)[1]
    assert code_lines(example) == code_lines("\n".join(fenced("python")))


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The example run once in a directory of its own, with what it printed."""
    import contextlib
    import io
    import os

    where = tmp_path_factory.mktemp("language-model")
    printed = io.StringIO()
    before = Path.cwd()
    os.chdir(where)
    try:
        with contextlib.redirect_stdout(printed):
            names = runpy.run_path(str(EXAMPLE), run_name="language_model")
    finally:
        os.chdir(before)
    return {**names, "printed": printed.getvalue(), "where": where}


def test_it_prints_the_pages_output(run: dict[str, Any]) -> None:
    assert run["printed"] == "".join(fenced("text"))


def test_the_console_block_is_what_inspect_prints(
    run: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    (console,) = fenced("console")
    command, *shown = console.splitlines()
    assert command == "$ lightning-iocatch inspect features/"
    capsys.readouterr()
    assert command_line(["inspect", str(run["where"] / "features")]) == 0
    printed = capsys.readouterr().out.splitlines()
    printed[0] = printed[0].replace(str(run["where"] / "features"), "features/")
    shown_lines = [line for line in shown if line != "..."]
    assert shown_lines and all(line in printed for line in shown_lines)
    assert printed[0] == shown[0] and printed[-1] == shown[-1]


def alone(run: dict[str, Any], text: str, zero_mlp: bool = False) -> dict[str, Any]:
    """One sentence through the GPT-2 alone, unpadded: block 1's output and the logits,
    with hand-written hooks (block 0's MLP output zeroed when asked)."""
    model = run["lm"].model
    ids = torch.tensor([[run["vocab"][word] for word in text.split()]])
    found: dict[str, Any] = {}
    hooks = [model.transformer.h[1].register_forward_hook(lambda m, i, o: found.update(h1=o))]
    if zero_mlp:
        mlp = model.transformer.h[0].mlp
        hooks.append(mlp.register_forward_hook(lambda m, i, o: torch.zeros_like(o)))
    try:
        with torch.no_grad():
            found["logits"] = model(input_ids=ids, use_cache=False).logits[0]
    finally:
        for hook in hooks:
            hook.remove()
    found["h1"], found["ids"] = found["h1"][0], ids[0]
    return found


def test_the_dump_holds_each_real_token_once_as_the_model_computes_it(
    run: dict[str, Any],
) -> None:
    store = FeatureStore(run["where"] / "features")  # the page's is relative to its run
    key, texts = run["KEY"], run["texts"]
    expected = [alone(run, text) for text in texts]
    index = torch.cat([torch.full((len(e["ids"]),), i) for i, e in enumerate(expected)])
    assert torch.equal(store.indices, index)
    positions = torch.cat([torch.arange(len(e["ids"])) for e in expected])
    assert torch.equal(store["__position__"].long(), positions)
    assert torch.equal(store["__token_id__"], torch.cat([e["ids"] for e in expected]))
    torch.testing.assert_close(store[key], torch.cat([e["h1"] for e in expected]))


def test_the_probe_the_sae_the_browser_and_the_effects_are_right(run: dict[str, Any]) -> None:
    texts = run["texts"]
    clean = [alone(run, text) for text in texts]
    zeroed = [alone(run, text, zero_mlp=True) for text in texts]

    # ActivationStats over block 1's real tokens (population std), NumPy float64
    h1 = np.concatenate([e["h1"].numpy().astype(np.float64) for e in clean])
    metrics = run["trainer"].callback_metrics
    prefix = "iocatch/model.transformer.h.1/outputs"
    assert float(metrics[f"{prefix}/mean"]) == pytest.approx(h1.mean(), abs=1e-6)
    assert float(metrics[f"{prefix}/std"]) == pytest.approx(h1.std(), rel=1e-4)

    # the SAE's epoch: every row once over the killed and the resumed run
    assert run["before"].rows + run["after"].rows == len(h1) == 72
    assert run["resumed"].global_step == 5  # 3 steps, then the epoch's last 2

    # the browser's best example of the unit shown: its value and its token
    summary, unit, sae = run["summary"], run["unit"], run["sae"]
    with torch.no_grad():
        codes = sae.encode(torch.from_numpy(h1).float())[:, unit].double().numpy()
    assert float(summary.top_values[unit, 0]) == pytest.approx(codes.max(), rel=1e-5)
    index, position = int(summary.top_index[unit, 0]), int(summary.top_position[unit, 0])
    word = texts[index].split()[position]
    assert run["tokenizer"].convert_ids_to_tokens(int(summary.context_ids[unit, 0, 2])) == word
    assert (run["where"] / "browser" / "index.html").is_file()

    # next-token loss over real tokens and KL(clean || zeroed) per real token, float64
    def losses(found: list[dict[str, Any]]) -> float:
        terms = []
        for e in found:
            logits = e["logits"].double().numpy()[:-1]
            logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
            terms += list(-logp[np.arange(len(logp)), e["ids"].numpy()[1:]])
        return float(np.mean(terms))

    kls = []
    for c, z in zip(clean, zeroed, strict=True):
        p = torch.log_softmax(c["logits"].double(), -1).numpy()
        q = torch.log_softmax(z["logits"].double(), -1).numpy()
        kls += list((np.exp(p) * (p - q)).sum(-1))
    values = run["effects"].last_values
    assert values["effects/clean/loss"] == pytest.approx(losses(clean), rel=1e-5)
    assert values["effects/mlp_0/loss"] == pytest.approx(losses(zeroed), rel=1e-5)
    assert values["effects/mlp_0/kl"] == pytest.approx(np.mean(kls), rel=1e-4)
