"""A language model from start to end: the code of docs/language-models.md.

    .venv/bin/python examples/language_model.py

A small random GPT-2 built from a config (nothing is downloaded) in a LightningModule,
a word-level tokenizer over toy sentences with a right-padding collator, then: the key
names, a dump of token rows, the store inspected, probes in validate, a sparse
autoencoder trained on the dump (stopped and resumed from its checkpoint), the top
examples of its latents in the feature browser, and an MLP ablation measured. Files
are written under the current directory. tests/test_language_model_page.py checks that
this file is the page's blocks and that it prints the page's output.
"""

# ruff: noqa: E402 (the imports stay where the page's blocks make them)
import torch
from lightning.pytorch import LightningModule, Trainer
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

subjects, verbs = ("the cat", "a dog", "the old fox"), ("ran", "sat on a mat", "slept")
skies, days = ("rain", "snow in the north", "sun"), ("today", "in rome", "all week")
animals = [f"{subject} {verb}" for subject in subjects for verb in verbs]
forecasts = [f"{sky} {day}" for sky in skies for day in days]
texts = [text for pair in zip(animals, forecasts, strict=True) for text in pair]
topics = [0, 1] * len(animals)  # animals, weather

words = sorted({word for text in texts for word in text.split()})
vocab = {word: i for i, word in enumerate(["<pad>", *words])}
core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>")
tokenizer.padding_side = "right"  # the rule for every step below
pairs = zip(texts, topics, strict=True)
dataset = [{**tokenizer(text), "topic": topic} for text, topic in pairs]


def collate(rows: list[dict]) -> dict[str, torch.Tensor]:
    """Pads on the right; `attention_mask` is 1 on the real tokens."""
    ids = [{"input_ids": row["input_ids"]} for row in rows]
    batch = dict(tokenizer.pad(ids, return_tensors="pt"))
    batch["topic"] = torch.tensor([row["topic"] for row in rows])
    return batch


class LanguageModel(LightningModule):
    """A random GPT-2 as `self.model`: its blocks are `model.transformer.h.0`, `.1`."""

    def __init__(self) -> None:
        super().__init__()
        config = GPT2Config(
            n_layer=2, n_embd=32, n_head=2, n_positions=16, vocab_size=len(vocab),
            bos_token_id=None, eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
        self.model = GPT2LMHeadModel(config)

    def forward(self, batch: dict[str, torch.Tensor]):
        ids, mask = batch["input_ids"], batch["attention_mask"]
        return self.model(input_ids=ids, attention_mask=mask, use_cache=False)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self(batch)

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self(batch)


torch.manual_seed(0)
lm = LanguageModel().eval()
loader = torch.utils.data.DataLoader(dataset, batch_size=6, collate_fn=collate)
quiet = dict(logger=False, enable_progress_bar=False, enable_model_summary=False)
batch = next(iter(loader))
real = sum(len(row["input_ids"]) for row in dataset)
print(f"{len(texts)} sentences, {len(vocab)} words, {real} real tokens; a batch:")
print(batch["input_ids"][:3], batch["attention_mask"][:3], sep="\n")

from lightning_iocatch.capture import ModelIOCatcher, flatten_captures

block = "model.transformer.h.0"
with ModelIOCatcher(lm, "cpu")(outputs=[block, f"{block}.attn", f"{block}.mlp"]) as got:
    lm(batch)
for key, value in flatten_captures(got).items():
    print(f"{key:38} {tuple(value.shape)}")

from lightning_iocatch import FeatureWriter, IOCaptureCallback, TokenRows

KEY = "model.transformer.h.1/outputs"  # a GPT-2 block returns a tensor: no "/0"
writer = FeatureWriter("features/", tokens=TokenRows())  # a row per real token
spec = "outputs[model.transformer.h.1]"
dump = IOCaptureCallback(spec, early_exit=True, writer=writer)
Trainer(callbacks=[dump], **quiet).predict(lm, loader, return_predictions=False)

from lightning_iocatch import FeatureStore

store = FeatureStore("features/")
print(store.keys(), tuple(store[KEY].shape))
print(store.indices[:8], store["__position__"][:8], store["__token_id__"][:8], sep="\n")

from lightning_iocatch.probes import ActivationStats, LinearProbe

probes = [ActivationStats(), LinearProbe(lambda batch: batch["topic"], num_classes=2)]
spec = "outputs[model.transformer.h.*]"
watch = IOCaptureCallback(spec, stages=["validate"], probes=probes)
trainer = Trainer(callbacks=[watch], **quiet)
trainer.validate(lm, loader, verbose=False)
for name, value in trainer.callback_metrics.items():
    print(f"{name:48} {float(value):8.4f}")

from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_iocatch import SAEModule, StoreDataModule


class Rows(Callback):
    """Counts the rows the training steps read."""

    rows = 0

    def on_train_batch_start(self, trainer, module, batch, batch_idx: int) -> None:
        self.rows += len(batch[KEY])  # [16, 32]: 16 token rows of block 1


rows = StoreDataModule("features/", KEY, batch_size=16, seed=0)
every_3 = ModelCheckpoint("checkpoints/", "{step}", every_n_train_steps=3)
before, after = Rows(), Rows()
killed = SAEModule(32, 128, "topk", k=4, key=KEY, lr=1e-3)  # TopK, 4 of 128 latents
Trainer(max_steps=3, callbacks=[every_3, before], **quiet).fit(killed, datamodule=rows)
resumed = SAEModule(32, 128, "topk", k=4, key=KEY, lr=1e-3)  # a new process
again = Trainer(max_epochs=1, callbacks=[every_3, after], **quiet)
again.fit(resumed, datamodule=rows, ckpt_path="checkpoints/step=3.ckpt")
sae = resumed.sae  # the SparseAutoencoder: encode, decode, save_saelens
print(f"rows before the kill: {before.rows}, after the resume: {after.rows}")
print(f"in all: {before.rows + after.rows} of {len(store[KEY])} rows, one epoch")

from lightning_iocatch.probes import UnitActivations
from lightning_iocatch.reports import summarize_store, write_browser

probe = UnitActivations(k=4, window=2, of=sae.encode)  # the SAE's latents
summary = summarize_store("features/", KEY, probe)
index = write_browser(summary, "browser/", tokenizer=tokenizer)  # open index.html
unit = int(summary.top_values[:, 0].nan_to_num(0).argmax())  # the largest value
print(f"latent {unit}: active on {int(summary.active[unit])} of {summary.rows} tokens")
for value, ids in zip(summary.top_values[unit], summary.context_ids[unit], strict=True):
    shown = [tokenizer.convert_ids_to_tokens(i) if i >= 0 else "" for i in ids.tolist()]
    shown[2] = f"[{shown[2]}]"  # the example's own token, between its neighbours
    print(f"{float(value):7.4f}  {' '.join(shown).strip()}")

from lightning_iocatch import InterventionEffects
from lightning_iocatch.capture import Zero

effects = InterventionEffects(
    {"mlp_0": [Zero("model.transformer.h.0.mlp")]},
    forward=lambda module, batch: module(batch),  # as validation_step calls it
)
Trainer(callbacks=[effects], **quiet).validate(lm, loader, verbose=False)
for name, value in effects.last_values.items():
    print(f"{name:24} {value:.4f}")
