"""Training text as bytes: the embedded default corpus or a user's file, split into train
and validation datasets of ``(input, target)`` windows."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.data import Dataset

__all__ = ["VOCAB_SIZE", "TokenWindows", "split_text", "load_text", "read_text_file", "embedded_text"]

VOCAB_SIZE = 256  # byte-level: every byte is a token, no tokenizer files to download


def embedded_text() -> str:
    """English text shipped with Python: the help topics of ``pydoc_data`` (~460 KB)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


def read_text_file(path: Path, what: str, fix: str) -> str:
    """The UTF-8 text of ``path``.

    Raises:
        ValueError: ``path`` is a directory, does not exist, or is not UTF-8; the message
            names ``what`` (e.g. ``"config file"``), the path and the ``fix``.
        OSError: the file cannot be read (permissions).
    """
    if path.is_dir():
        raise ValueError(f"{what} {str(path)!r} is a directory; {fix}")
    if not path.is_file():
        raise ValueError(f"{what} {str(path)!r} does not exist; {fix}")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{what} {str(path)!r} is not UTF-8 text ({error.reason} at byte {error.start})") from None


def load_text(path: str | Path | None) -> str:
    """The training text: ``path``'s contents, or the embedded default when ``path`` is None.

    Raises:
        ValueError: the file is missing, a directory, unreadable as UTF-8, or empty.
        OSError: the file cannot be read (permissions).
    """
    if path is None:
        return embedded_text()
    path = Path(path)
    text = read_text_file(path, "data file", "pass an existing text file or omit --data")
    if not text.strip():
        raise ValueError(f"data file {str(path)!r} is empty; it needs text to train on")
    return text


class TokenWindows(Dataset):
    """Map-style dataset of every ``seq_len + 1`` window of a token tensor:
    item ``i`` is ``(tokens[i : i + seq_len], tokens[i + 1 : i + seq_len + 1])``."""

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self) -> int:
        return max(len(self.tokens) - self.seq_len, 0)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.tokens[index : index + self.seq_len + 1]
        return window[:-1], window[1:]


def split_text(text: str, seq_len: int, val_fraction: float = 0.1) -> tuple[TokenWindows, TokenWindows]:
    """Byte tokens of ``text`` split into train (first ``1 - val_fraction``) and validation.

    Raises:
        ValueError: a split too short for one window of ``seq_len + 1`` bytes.
    """
    tokens = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).to(torch.long)
    split = int(len(tokens) * (1 - val_fraction))
    parts = {"train": tokens[:split], "validation": tokens[split:]}
    for name, part in parts.items():
        if len(part) < seq_len + 1:
            raise ValueError(
                f"the {name} split has {len(part)} bytes, fewer than seq_len + 1 = {seq_len + 1}; "
                "use a longer text or a shorter seq_len"
            )
    return TokenWindows(parts["train"], seq_len), TokenWindows(parts["validation"], seq_len)
