"""What torchtitan reads from its own repository's ``tests/assets``, made here: nothing can be
fetched from a hub on this machine, and torchtitan's wheel ships neither.

- ``tests/assets/tokenizer``: a byte-level BPE tokenizer (``tokenizer.json`` and its
  ``tokenizer_config.json`` naming the BOS/EOS tokens), trained on the text below, with a
  vocabulary inside the debug models' 2,048 entries;
- ``tests/assets/c4_test``: the text dataset torchtitan's ``c4_test`` names, a folder of JSON lines
  with a ``text`` field, as ``datasets.load_dataset(path, split="train")`` reads it.

The text is drawn from a fixed word list with a fixed seed, so every run trains on the same tokens.
Where torchtitan comes from: ``torchtitan_site()`` (``make test`` installs it into
``build/torchtitan-site``, apart from the test environment: its ``datasets`` pins a
``huggingface-hub`` older than the one transformers needs).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SITE_ENV = "RESILRUN_TEST_TORCHTITAN_SITE"
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"

_TEXT = (
    "the a of to and in is it that for on with as was at by be this from or have an not are but "
    "they which one you were all we can there been has more if will would their what so when who "
    "model train step loss rank node spare host memory snapshot replica restore gradient batch "
    "token layer weight shard tensor device network failure recovery checkpoint storage peer "
    "river mountain garden window bridge morning evening summer winter market harbor village "
    "quickly slowly quietly bright dark warm cold green blue red small large early late"
)
_WORDS = _TEXT.split(" ")


def torchtitan_site() -> Path | None:
    """The folder torchtitan is installed in for the tests, or None when it is not there."""
    site = Path(os.environ.get(SITE_ENV, REPO / "build" / "torchtitan-site"))
    return site if (site / "torchtitan" / "__init__.py").is_file() else None


def lines(count: int = 400, seed: int = 1234) -> list[str]:
    draw = random.Random(seed)
    out = []
    for _ in range(count):
        sentences = []
        for _ in range(draw.randint(3, 8)):
            words = draw.choices(_WORDS, k=draw.randint(6, 18))
            sentences.append(" ".join(words).capitalize() + ".")
        out.append(" ".join(sentences))
    return out


def make(root: Path, vocab_size: int = 1024) -> Path:
    """Write ``root/tests/assets``; torchtitan is then run with ``root`` as its working folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    text = lines()
    assets = root / "tests" / "assets"
    data = assets / "c4_test"
    data.mkdir(parents=True, exist_ok=True)
    with open(data / "train.json", "w", encoding="utf-8") as handle:  # the name gives the split
        for line in text:
            handle.write(json.dumps({"text": line}) + "\n")

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(text, trainer=trainer)
    folder = assets / "tokenizer"
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": EOS, "add_bos_token": True, "add_eos_token": True}
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return assets
