"""Self-distillation (paper 2.3.2): the backbone's own replies to seed prompts, as JSONL.

Heads trained on these replies learn the backbone's distribution, not a dataset's. Replies are greedy
by default, or drawn with the sampling settings a chat serves (``SamplingConfig``: temperature, top-k,
top-p, min-p, repetition penalty, HF ``generate`` semantics), so that heads learn the text they will
be asked to guess. Output is plain JSONL, or gzip-compressed (``.jsonl.gz``: one gzip member per batch,
small enough to keep in the repository so a long run resumes in a later session on another machine).
"""

from __future__ import annotations

import gzip
import itertools
import json
import math
import zlib
from contextlib import nullcontext
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import LogitsProcessor, LogitsProcessorList

from ..acceptance import choose_token
from ..processors import NodeProcessors, SamplingConfig

#: An assistant turn whose content is None in a seed chat: the backbone writes it during distillation.
MODEL_TURN = {"role": "assistant", "content": None}


def read_prompts(path: str | Path) -> list[list[dict]]:
    """Seed conversations from a ``.txt`` (one prompt per line) or ``.jsonl`` file.

    A JSONL row holds ``messages`` (a chat; trailing assistant turns are dropped so the model answers
    the last user turn) or ``prompt`` with an optional ``system``, and optionally ``followup``: a
    further user turn asked after the model's own reply (the chat then holds ``MODEL_TURN`` between
    the two user turns). Returns a list of message lists.
    Raises ``ValueError`` for a row with neither ``messages`` nor ``prompt``.
    """
    path = Path(path)
    if path.suffix == ".txt":
        return [[{"role": "user", "content": line.strip()}] for line in path.read_text().splitlines() if line.strip()]
    chats = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if "messages" in row:
            messages = list(row["messages"])
            while messages and messages[-1]["role"] == "assistant":
                messages.pop()
        elif "prompt" in row:
            messages = ([{"role": "system", "content": row["system"]}] if row.get("system") else [])
            messages.append({"role": "user", "content": row["prompt"]})
        else:
            raise ValueError(f"{path}:{n}: a row needs 'messages' or 'prompt'")
        if row.get("followup"):
            messages += [dict(MODEL_TURN), {"role": "user", "content": row["followup"]}]
        chats.append(messages)
    return chats


def distill(
    backbone,
    tokenizer,
    chats: list[list[dict]],
    out: str | Path,
    *,
    max_new_tokens: int = 256,
    batch_size: int = 32,
    bf16: bool = False,
    sampling: SamplingConfig = SamplingConfig(),
    seed: int = 0,
) -> Path:
    """Write the backbone's replies to ``chats`` as JSONL (paper 2.3.2, self-distillation).

    ``sampling`` says how replies are drawn (default greedy): at temperature 0 the argmax of the
    penalised logits, else a sample from HF ``generate``'s processed distribution with those settings
    (on a CPU drawn by ``SampledTokens`` inside ``generate``'s greedy search: HF's top-p sorts and its
    multinomial draws over the whole vocabulary of every row, most of a batched step there; ``generate_kwargs``);
    the generators are seeded per batch from ``seed`` and the batch's ids, so a resumed run draws what an
    uninterrupted one would for the same batches. ``out`` ending in ``.gz`` is written as one gzip
    member per batch (``read_distilled`` drops a member cut short by a crash, and a resumed run cuts
    it off the file before appending).

    Each row: ``id``, ``messages``, ``prompt_ids``, ``reply_ids`` (cut after the first EOS), ``reply``.
    A chat holding ``MODEL_TURN`` placeholders is answered turn by turn: the model's reply fills the
    first placeholder, then the conversation goes on with that reply. The first reply of chat ``i``
    has id ``i``, its later replies ``"i.1"``, ``"i.2"``, ... Resumable: a conversation ``out`` already
    answers (the same ``messages``, whatever its index was then) is skipped and its reply read back for the
    next turn, so a prompt file rebuilt in another order (on another machine) resumes without answering a
    prompt twice; a new chat whose index an earlier row holds gets the next unused id. Prompts are batched by length with
    left padding. ``bf16`` runs under bfloat16 autocast (CPU/CUDA); plain bf16 weights
    (``backbone.to(torch.bfloat16)``) are faster on CPU.
    """
    out = Path(out)
    written = read_distilled(out, repair=True) if out.exists() else []
    done = {_conversation(row["messages"]): row for row in written}
    labels, taken = _chat_ids_for(chats, done, written)
    eos = backbone.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
    tokenizer.padding_side = "left"
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(eos_ids))
    device = next(backbone.parameters()).device
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext()
    pending = list(enumerate(chats))  # (chat index, messages) still holding turns to write
    turn = 0
    with _Appender(out) as f:
        while pending:
            todo, ready, replies = [], [], {}
            for i, messages in pending:
                cut = _turn_end(messages)
                key = labels[i] if turn == 0 else f"{labels[i]}.{turn}"
                row = done.get(_conversation(messages[:cut]))
                if row is not None:
                    replies[key] = row["reply_ids"]
                (ready if row is not None else todo).append((key, i, messages[:cut], messages[cut + 1 :]))
            todo = [(_unused(k, taken), i, m, rest, _chat_ids(tokenizer, m)) for k, i, m, rest in todo]
            todo.sort(key=lambda r: len(r[4]))
            for start in tqdm(range(0, len(todo), batch_size), desc=f"distill turn {turn + 1}", unit="batch"):
                batch = todo[start : start + batch_size]
                width = max(len(r[4]) for r in batch)
                input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
                mask = torch.zeros_like(input_ids)
                for row, ids in enumerate(r[4] for r in batch):
                    input_ids[row, width - len(ids) :] = torch.tensor(ids)
                    mask[row, width - len(ids) :] = 1
                batch_seed = seed ^ zlib.crc32(json.dumps([r[0] for r in batch]).encode())
                torch.manual_seed(batch_seed)  # HF's own sampling, off the CPU (generate_kwargs)
                generator = torch.Generator(device).manual_seed(batch_seed)
                with torch.inference_mode(), autocast:
                    generated = backbone.generate(
                        input_ids=input_ids.to(device),
                        attention_mask=mask.to(device),
                        max_new_tokens=max_new_tokens,
                        pad_token_id=pad_id,
                        **generate_kwargs(sampling, generator),
                    )[:, width:].tolist()
                rows = []
                for (key, _, messages, _, ids), reply in zip(batch, generated):
                    reply = reply[: next((n + 1 for n, t in enumerate(reply) if t in eos_ids), len(reply))]
                    replies[key] = reply
                    rows.append({"id": key, "messages": messages, "prompt_ids": ids, "reply_ids": reply,
                                 "reply": tokenizer.decode(reply, skip_special_tokens=True)})
                f.write(rows)
            turn += 1
            pending = [
                (i, messages + [{"role": "assistant", "content": tokenizer.decode(replies[key], skip_special_tokens=True)}] + rest)
                for key, i, messages, rest, *_ in ready + todo
                if rest
            ]
    return out


def _turn_end(messages: list[dict]) -> int:
    """Index of a chat's first ``MODEL_TURN`` placeholder (the messages before it are the turn to answer), else its length."""
    return next((n for n, m in enumerate(messages) if m == MODEL_TURN), len(messages))


def _conversation(messages: list[dict]) -> str:
    """A conversation's identity for resuming: its messages as canonical JSON."""
    return json.dumps(messages, sort_keys=True, ensure_ascii=False)


def _chat_ids_for(chats: list[list[dict]], done: dict[str, dict], written: list[dict]) -> tuple[list[int], set]:
    """Each chat's id: the id of the row that already answers its first turn, else its index, else (an earlier
    row holds that index) the next id no row holds; and the set of ids taken, these included."""
    taken = {row["id"] for row in written}
    spare = itertools.count(max((row["id"] for row in written if isinstance(row["id"], int)), default=-1) + 1)
    labels = []
    for i, messages in enumerate(chats):
        row = done.get(_conversation(messages[: _turn_end(messages)]))
        label = row["id"] if row is not None else i
        if row is None and label in taken:
            label = next(n for n in spare if n not in taken)
        taken.add(label)
        labels.append(label)
    return labels, taken


def _unused(key, taken: set):
    """``key`` for a new row, or for a later turn whose id an earlier row of another conversation holds (the
    same first turn with another follow-up) ``"{key}.1"``, ``"{key}.2"``, ...; marked taken."""
    if isinstance(key, str) and key in taken:
        key = next(f"{key}.{n}" for n in itertools.count(1) if f"{key}.{n}" not in taken)
    taken.add(key)
    return key


def _chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a chat with the generation prompt appended."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


class SampledTokens(LogitsProcessor):
    """A sampling step as a logits processor, for ``generate``'s greedy search: each row's scores [B, V] go
    through ``NodeProcessors`` (the repetition penalty over the row's ids, the temperature, top-k / top-p /
    min-p: equal to HF's processors, the filters decided on each row's most likely tokens) and one token is
    drawn from their softmax with ``generator`` (``acceptance.choose_token``: one uniform and a cumulative sum,
    compiled where ``medusa_core.lean`` loads); the result is 0 at the drawn token and -inf elsewhere, so the
    greedy search takes it. The law is ``generate(do_sample=True)``'s, with another random stream.

    Args:
        sampling: settings with a temperature above 0 (greedy needs no draw).
        generator: the source of the draws (on the scores' device).

    Raises ``ValueError`` for greedy ``sampling``.
    """

    def __init__(self, sampling: SamplingConfig, generator: torch.Generator):
        if sampling.greedy:
            raise ValueError(f"SampledTokens draws a sample; temperature {sampling.temperature} is greedy")
        self.processors, self.generator = NodeProcessors(sampling), generator

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        processed = self.processors(scores.float(), input_ids)  # [B, V]
        drawn = torch.stack([choose_token(row, False, self.generator) for row in processed])  # [B]
        return torch.full_like(scores, -math.inf).scatter_(1, drawn.view(-1, 1).to(scores.device), 0.0)


def generate_kwargs(sampling: SamplingConfig, generator: torch.Generator) -> dict:
    """HF ``generate`` keywords that draw from ``sampling``'s distribution: greedy settings as ``do_sample=False``
    with the repetition penalty; sampling with a CPU ``generator`` as a greedy search over ``SampledTokens``' draws
    from it (the law of ``do_sample=True`` with those settings), elsewhere as ``do_sample=True`` (filters that are
    off left out), which draws from torch's global generator."""
    if sampling.greedy:
        return {"do_sample": False, "repetition_penalty": sampling.repetition_penalty}
    if generator.device.type != "cpu":  # HF's own sampling (from torch's global generator): cheap on a GPU
        return {"do_sample": True, "repetition_penalty": sampling.repetition_penalty, "temperature": sampling.temperature,
                "top_k": sampling.top_k or None, "top_p": sampling.top_p, "min_p": sampling.min_p or None}
    # HF's own penalty off (a generation config's would apply it twice): SampledTokens penalises
    return {"do_sample": False, "repetition_penalty": 1.0, "logits_processor": LogitsProcessorList([SampledTokens(sampling, generator)])}


def read_distilled(path: str | Path, *, repair: bool = False) -> list[dict]:
    """Rows written by ``distill`` (plain or ``.gz`` JSONL).

    A ``.gz`` file's last gzip member cut short (a run killed while writing) is skipped; with
    ``repair`` it is also cut off the file, so that appended members stay readable.
    """
    path = Path(path)
    if path.suffix != ".gz":
        with open(path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    data = path.read_bytes()
    rows, offset = [], 0
    while offset < len(data):
        member = zlib.decompressobj(wbits=31)  # one gzip member
        try:
            text = member.decompress(data[offset:]) + member.flush()
        except zlib.error:
            break
        if not member.eof:
            break
        rows += [json.loads(line) for line in text.decode("utf-8").splitlines() if line.strip()]
        offset = len(data) - len(member.unused_data)
    if repair and offset < len(data):
        with open(path, "r+b") as f:
            f.truncate(offset)
    return rows


class _Appender:
    """Appends a batch of rows to a JSONL file, or as one gzip member to a ``.gz`` file, and flushes it."""

    def __init__(self, path: Path):
        self.path, self.gz = path, path.suffix == ".gz"

    def __enter__(self) -> "_Appender":
        self.file = open(self.path, "ab")
        return self

    def write(self, rows: list[dict]) -> None:
        text = "".join(json.dumps(row) + "\n" for row in rows).encode("utf-8")
        self.file.write(gzip.compress(text, mtime=0) if self.gz else text)
        self.file.flush()

    def __exit__(self, *exc) -> None:
        self.file.close()
