"""Train the two demo checkpoints in mismatch_probe/data/models/ (a Qwen3-MoE and its dense twin) on a synthetic corpus.

Random-init models have near-flat next-token distributions, so their training-inference mismatch is tiny.
These models are trained until their sampled tokens are confident, which is what makes the mismatch visible.
Everything is derived from SEED; the weights are reproducible bit for bit for a fixed torch version and thread count.

    .venv/bin/python scripts/train_demo_models.py    # about 6 minutes on one CPU core; or, side by side on two:
    .venv/bin/python scripts/train_demo_models.py --only moe & .venv/bin/python scripts/train_demo_models.py --only dense
    .venv/bin/python scripts/check_demo_mismatch.py  # then check the mismatch the demo relies on
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    GenerationConfig,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

ROOT = Path(__file__).resolve().parent.parent
SEED = 1234
EOS, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

COLORS = "red blue green black white brown small big old young".split()
NOUNS = "cat dog bird fish cow fox owl bee frog duck".split()
# each noun has its own verb, so the sentence continuation is partly predictable
VERBS = dict(zip(NOUNS, "sat ran flew swam slept hid looked buzzed jumped walked".split()))
PLACES = "mat hill tree lake barn road roof wall pond box".split()
PREPS = "on near under by".split()
WORDS = sorted(set(COLORS + NOUNS + PLACES + "sun moon star rain snow wind sky sea cup pen book door".split()))


# ---------------------------------------------------------------- corpus


def _add(rng):
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    return f"{a}+{b}=", f"{a + b}"


def _mul(rng):
    a, b = rng.randint(2, 19), rng.randint(2, 12)
    return f"{a}*{b}=", f"{a * b}"


def _count(rng):
    start, n = rng.randint(0, 90), rng.randint(8, 16)
    return f"count from {start} to {start + n - 1}:", " " + " ".join(str(start + i) for i in range(n))


def _reverse(rng):
    words = rng.sample(WORDS, rng.randint(4, 8))
    return f"reverse: {' '.join(words)} ->", " " + " ".join(reversed(words))


def _sort(rng):
    digits = [rng.randint(0, 9) for _ in range(rng.randint(5, 10))]
    return f"sort {' '.join(map(str, digits))}:", " " + " ".join(map(str, sorted(digits)))


def _spell(rng):
    word = rng.choice(WORDS)
    times = rng.randint(3, 6)
    return f"say {word} {times} times:", " " + " ".join([word] * times)


def _sentence(rng):
    color, noun = rng.choice(COLORS), rng.choice(NOUNS)
    return f"the {color} {noun}", f" {VERBS[noun]} {rng.choice(PREPS)} the {rng.choice(PLACES)}."


def _story(rng):
    # a long answer with an uncertain slot every few tokens: each place, preposition and second animal is a free choice
    color, noun, other = rng.choice(COLORS), rng.choice(NOUNS), rng.choice(NOUNS)
    return f"story of the {color} {noun}:", (
        f" the {color} {noun} {VERBS[noun]} {rng.choice(PREPS)} the {rng.choice(PLACES)}."
        f" it met a {other} {rng.choice(PREPS)} the {rng.choice(PLACES)}."
        f" the {other} {VERBS[other]} to the {rng.choice(PLACES)}. the end."
    )


def _walk(rng):
    # each step goes up or down by one: about ln 2 nats at every number
    value, n = rng.randint(5, 94), rng.randint(10, 16)
    steps = [value]
    for _ in range(n - 1):
        value += rng.choice((-1, 1))
        steps.append(value)
    return f"walk from {steps[0]}:", " " + " ".join(map(str, steps))


def _pick(rng):
    # every word is drawn from the three the prompt names: about ln 3 nats per word
    choices, n = rng.sample(WORDS, 3), rng.randint(8, 14)
    return f"pick {n} of {' '.join(choices)}:", " " + " ".join(rng.choice(choices) for _ in range(n))


# the long answers with uncertain slots carry most of the sampled tokens, so most of the measured mismatch
TASKS = (_add, _mul, _count, _reverse, _sort, _spell, _sentence, _story, _walk, _pick)
WEIGHTS = (1, 1, 1, 1, 1, 1, 1, 4, 3, 3)


def sample_task(rng: random.Random) -> tuple[str, str]:
    return rng.choices(TASKS, WEIGHTS)[0](rng)


def chat_text(prompt: str, answer: str | None) -> str:
    head = f"{IM_START}user\n{prompt}{IM_END}\n{IM_START}assistant\n"
    return head if answer is None else head + answer.lstrip() + IM_END + EOS


@dataclass
class Corpus:
    train_docs: list[str]  # each ends with EOS or <|im_end|>
    heldout_prompts: list[str]
    heldout_chat: list[str]


def build_corpus(seed: int, n_docs: int, n_heldout: int, n_chat: int, chat_share: float) -> Corpus:
    rng = random.Random(seed)
    held, chat = [], []
    while len(held) < n_heldout:
        prompt, _ = sample_task(rng)
        if prompt not in held:
            held.append(prompt)
    while len(chat) < n_chat:
        prompt, _ = sample_task(rng)
        if prompt not in held and prompt not in chat:
            chat.append(prompt)
    reserved = set(held) | set(chat)
    docs = []
    while len(docs) < n_docs:
        prompt, answer = sample_task(rng)
        if prompt in reserved:
            continue
        docs.append(chat_text(prompt, answer) if rng.random() < chat_share else prompt + answer + EOS)
    return Corpus(docs, held, chat)


# ---------------------------------------------------------------- tokenizer


def train_tokenizer(docs: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    # one token per digit (with its leading space) keeps arithmetic learnable; byte-level keeps any string encodable
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r" ?[0-9]| ?[^\s0-9]+|\s+"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, pad_token=EOS, additional_special_tokens=[IM_START, IM_END]
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.padding_side = "left"
    return fast


def pack_rows(docs_ids: list[list[int]], seq_len: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy-pack whole documents into rows that start at a document boundary (as generation does)."""
    rows, row = [], []
    for ids in docs_ids:
        if len(row) + len(ids) > seq_len:
            rows.append(row)
            row = []
        row = row + ids[:seq_len]
    rows.append(row)
    input_ids = torch.full((len(rows), seq_len), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), seq_len), -100, dtype=torch.long)
    for i, r in enumerate(rows):
        input_ids[i, : len(r)] = torch.tensor(r)
        labels[i, : len(r)] = torch.tensor(r)
    return input_ids, labels


# ---------------------------------------------------------------- models

COMMON = dict(
    hidden_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=256,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    tie_word_embeddings=False,
    initializer_range=0.1,
)


def make_model(
    kind: str, tok: PreTrainedTokenizerFast, layers: int, experts: int, top_k: int, moe_width: int, aux_coef: float
):
    ids = dict(
        vocab_size=len(tok),
        eos_token_id=tok.convert_tokens_to_ids(EOS),
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    if kind == "moe":
        cfg = Qwen3MoeConfig(
            **COMMON,
            num_hidden_layers=layers,
            **ids,
            intermediate_size=top_k * moe_width,
            moe_intermediate_size=moe_width,
            num_experts=experts,
            num_experts_per_tok=top_k,
            norm_topk_prob=True,
            router_aux_loss_coef=aux_coef,
            output_router_logits=True,
        )
        return Qwen3MoeForCausalLM(cfg)
    # the dense twin's MLP is as wide as the MoE's active experts
    return Qwen3ForCausalLM(Qwen3Config(**COMMON, **ids, num_hidden_layers=layers, intermediate_size=top_k * moe_width))


def lr_at(step: int, steps: int, peak: float) -> float:
    warm = max(1, steps // 20)
    if step < warm:
        return peak * (step + 1) / warm
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, steps - warm))))


def train(model, input_ids, labels, steps, batch, lr, wd, seed, log) -> float:
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=wd)
    model.train()
    ema = None
    t0 = time.time()
    for step in range(steps):
        idx = torch.randint(0, input_ids.shape[0], (batch,), generator=gen)
        x, y = input_ids[idx], labels[idx]
        mask = (y != -100).long()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, lr)
        out = model(input_ids=x, attention_mask=mask, labels=y)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        aux = getattr(out, "aux_loss", None)
        lm = out.loss.item() - (model.config.router_aux_loss_coef * aux.item() if aux is not None else 0.0)
        ema = lm if ema is None else 0.95 * ema + 0.05 * lm
        if step % 100 == 0 or step == steps - 1:
            log(f"  step {step:5d}  lm loss {lm:.4f}  (ema {ema:.4f})  {time.time() - t0:.0f} s")
    model.eval()
    if hasattr(model.config, "output_router_logits"):
        model.config.output_router_logits = False  # inference returns no router logits
    return ema


# ---------------------------------------------------------------- evaluation


@torch.no_grad()
def sampled_entropy(model, tok, prompts: list[str], max_new_tokens: int, seed: int) -> tuple[float, int, list[str]]:
    """Mean entropy (nats) of the next-token distribution at tokens sampled at temperature 1."""
    torch.manual_seed(seed)
    enc = tok(prompts, return_tensors="pt", padding=True)
    out = model.generate(
        **enc,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max_new_tokens,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=tok.pad_token_id,
    )
    logits = torch.stack(out.logits, dim=1).float()  # [B, T, V]
    logp = torch.log_softmax(logits, -1)
    ent = -(logp.exp() * logp).sum(-1)
    new = out.sequences[:, enc["input_ids"].shape[1] :]
    # a step counts until (and including) the first end token of its row
    ended = torch.isin(new, torch.tensor(end_ids(tok)))
    live = (ended.cumsum(1) - ended.long()) == 0
    texts = [tok.decode(row[m]) for row, m in zip(new, live)]
    return (ent * live).sum().item() / live.sum().item(), int(live.sum()), texts


def end_ids(tok) -> list[int]:
    return [tok.convert_tokens_to_ids(EOS), tok.convert_tokens_to_ids(IM_END)]


@torch.no_grad()
def expert_load(model, input_ids, labels) -> list[list[float]]:
    """Fraction of routed (token, slot) pairs that each expert receives, per layer."""
    mask = (labels != -100).reshape(-1)
    out = model(input_ids=input_ids, attention_mask=mask.view(labels.shape).long(), output_router_logits=True)
    loads = []
    k, n = model.config.num_experts_per_tok, model.config.num_experts
    for logits in out.router_logits:
        top = logits.topk(k, dim=-1).indices[mask]
        loads.append((torch.bincount(top.reshape(-1), minlength=n).float() / top.numel()).tolist())
    return loads


def accuracy(model, tok, prompts: list[str], answers: list[str]) -> float:
    enc = tok(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**enc, do_sample=False, max_new_tokens=48, pad_token_id=tok.pad_token_id)
    texts = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    return sum(t.strip() == a.strip() for t, a in zip(texts, answers)) / len(prompts)


# ---------------------------------------------------------------- main


def active_params(model) -> int:
    """Parameters one token passes through: all but the experts it is not routed to."""
    total = sum(p.numel() for p in model.parameters())
    cfg = model.config
    if not getattr(cfg, "num_experts", 0):
        return total
    expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n) // cfg.num_experts
    return total - expert * (cfg.num_experts - cfg.num_experts_per_tok)


def set_generation_config(model, tok) -> None:
    # sampling defaults are explicit so that servers reading generation_config.json sample the plain softmax
    model.generation_config = GenerationConfig(
        eos_token_id=end_ids(tok), pad_token_id=tok.pad_token_id, do_sample=True, temperature=1.0, top_k=0, top_p=1.0
    )


def save(model, tok, out_dir: Path) -> int:
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    config_path = out_dir / "config.json"
    cfg = json.loads(config_path.read_text())
    if "num_local_experts" in cfg:  # engines built on older transformers read Qwen3-MoE's expert count from here
        cfg["num_experts"] = cfg["num_local_experts"]
        config_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tok.save_pretrained(out_dir)
    # written by hand in the plain form that transformers 4.x and 5.x (and the engines built on them) all read
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS,
        "pad_token": EOS,
        "additional_special_tokens": [IM_START, IM_END],
        "model_max_length": COMMON["max_position_embeddings"],
        "padding_side": "left",
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    (out_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return sum(f.stat().st_size for f in out_dir.iterdir() if f.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--docs", type=int, default=20000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--moe-width", type=int, default=64)
    ap.add_argument("--wd", type=float, default=0.01)
    ap.add_argument("--aux-coef", type=float, default=0.1, help="load-balancing loss coefficient of the MoE model")
    ap.add_argument("--only", choices=["moe", "dense"], default=None)
    ap.add_argument("--out", type=Path, default=ROOT / "mismatch_probe" / "data")
    args = ap.parse_args()

    t0 = time.time()
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    random.seed(SEED)
    lines: list[str] = []

    def log(msg: str) -> None:
        print(msg, flush=True)
        lines.append(msg)

    corpus = build_corpus(SEED, args.docs, n_heldout=256, n_chat=8, chat_share=0.2)
    tok = train_tokenizer(corpus.train_docs, vocab_size=512)
    docs_ids = [tok(d)["input_ids"] for d in corpus.train_docs]
    input_ids, labels = pack_rows(docs_ids, args.seq_len, tok.pad_token_id)
    n_tok = sum(map(len, docs_ids))
    log(f"corpus: {len(docs_ids)} documents, {n_tok} tokens, {input_ids.shape[0]} rows; vocab {len(tok)}")

    prompts_dir = args.out / "prompts"
    prompts_dir.mkdir(parents=True, exist_ok=True)
    with open(prompts_dir / "demo.jsonl", "w") as f:
        for p in corpus.heldout_prompts:
            f.write(json.dumps({"prompt": p}) + "\n")
    with open(prompts_dir / "chat.jsonl", "w") as f:
        for p in corpus.heldout_chat:
            f.write(json.dumps({"messages": [{"role": "user", "content": p}]}) + "\n")

    eval_rows = input_ids[:256], labels[:256]
    report = {}
    for kind in ["moe", "dense"] if args.only is None else [args.only]:
        t_kind = time.time()
        torch.manual_seed(SEED)
        model = make_model(kind, tok, args.layers, args.experts, args.top_k, args.moe_width, args.aux_coef)
        n_params = sum(p.numel() for p in model.parameters())
        log(f"{kind}: {type(model).__name__}, {n_params} parameters; training {args.steps} steps x {args.batch} rows")
        loss = train(model, input_ids, labels, args.steps, args.batch, args.lr, args.wd, SEED, log)
        set_generation_config(model, tok)
        ent, n_sampled, texts = sampled_entropy(model, tok, corpus.heldout_prompts[:64], 64, SEED)
        chat_prompts = [chat_text(p, None) for p in corpus.heldout_chat]
        chat_ent, _, chat_texts = sampled_entropy(model, tok, chat_prompts, 48, SEED)
        checkable = [p for p in corpus.heldout_prompts[:64] if task_answer(p)]
        acc = accuracy(model, tok, checkable, [task_answer(p) for p in checkable])
        loads = expert_load(model, *eval_rows) if kind == "moe" else []
        size = save(model, tok, args.out / "models" / kind)
        report[kind] = dict(
            arch=type(model).__name__,
            params=n_params,
            loss=loss,
            entropy=ent,
            n_sampled=n_sampled,
            chat_entropy=chat_ent,
            accuracy=acc,
            loads=loads,
            size=size,
            seconds=time.time() - t_kind,
            active=active_params(model),
            samples=[*zip(corpus.heldout_prompts[:4], texts[:4]), *zip(corpus.heldout_chat[:2], chat_texts[:2])],
        )
        log(
            f"{kind}: final lm loss {loss:.4f}, sampled entropy {ent:.3f} nats ({n_sampled} tokens), "
            f"chat {chat_ent:.3f}, greedy exact-answer rate {acc:.2f}, folder {size / 1e6:.2f} MB"
        )
        for i, load in enumerate(loads):
            log(f"  layer {i} expert load: " + " ".join(f"{x:.2f}" for x in load))
        for p, t in report[kind]["samples"]:
            log(f"  {p!r} -> {t!r}")
    for kind, r in report.items():  # kept so that two --only runs (one per core) can be merged into TRAINING.md
        (args.out / "models" / f"training_{kind}.json").write_text(json.dumps(r, indent=1))
    reports = {k: args.out / "models" / f"training_{k}.json" for k in ("moe", "dense")}
    merged = {k: json.loads(p.read_text()) for k, p in reports.items() if p.is_file()}
    if len(merged) == 2:
        write_training_md(args, corpus, n_tok, len(tok), merged, time.time() - t0)
    log(f"total wall time {time.time() - t0:.0f} s")


def task_answer(prompt: str) -> str:
    """The exact answer to a prompt; empty for sentences, which have several valid endings."""
    if prompt.endswith("=") and "+" in prompt:
        a, b = prompt[:-1].split("+")
        return str(int(a) + int(b))
    if prompt.endswith("=") and "*" in prompt:
        a, b = prompt[:-1].split("*")
        return str(int(a) * int(b))
    if prompt.startswith("count from"):
        a, b = prompt[len("count from ") : -1].split(" to ")
        return " ".join(str(i) for i in range(int(a), int(b) + 1))
    if prompt.startswith("reverse:"):
        return " ".join(reversed(prompt[len("reverse: ") : -3].split()))
    if prompt.startswith("sort"):
        return " ".join(sorted(prompt[5:-1].split()))
    if prompt.startswith("say"):
        _, word, times, _ = prompt.split()
        return " ".join([word] * int(times))
    return ""


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_training_md(args, corpus, n_tok, vocab, report, wall) -> None:
    moe, dense = report["moe"], report["dense"]
    md = [
        "# Demo models",
        "",
        f"Produced by `scripts/train_demo_models.py` (deterministic: seed {SEED}, {args.threads} CPU thread(s), "
        f"torch {torch.__version__}). Wall time of the run that wrote this file: {wall:.0f} s.",
        "",
        "## Corpus",
        f"{len(corpus.train_docs)} synthetic documents ({n_tok} tokens); 20% are wrapped in the chat template "
        "(answer, `<|im_end|>`, `<|endoftext|>`), the rest are `prompt + answer + <|endoftext|>`. Tasks: "
        "addition (`17+25=42`), multiplication (`7*8=56`), counting (`count from 3 to 12: 3 4 ... 12`), "
        "word reversal (`reverse: sun cat cup owl -> owl cup cat sun`), digit sorting (`sort 5 3 9 1 4: 1 3 4 5 9`), "
        "repetition (`say owl 3 times: owl owl owl`) and templated sentences (`the red cat` -> ` sat on the mat.`: "
        "the verb follows from the animal, preposition and place are random), and three long-answer tasks with "
        "genuinely uncertain slots that carry most of the sampled tokens: short stories (`story of the red cat:` -> "
        "` the red cat sat on the mat. it met a dog near the hill. the dog ran to the barn. the end.`: prepositions, "
        "places and the second animal are free), random walks (`walk from 40: 40 41 40 39 ...`, each step +1 or -1) "
        "and picks (`pick 8 of sun cup owl: owl sun sun ...`, each word one of the three named). Task weights "
        f"{'/'.join(map(str, WEIGHTS))} in that order. "
        f"The {len(corpus.heldout_prompts)} prompts in `data/prompts/demo.jsonl` and the {len(corpus.heldout_chat)} in "
        "`data/prompts/chat.jsonl` never occur as prompts in the training corpus.",
        "",
        f"Tokenizer: byte-level BPE, one token per digit, vocabulary {vocab}, special tokens `{EOS}` (eos and pad), "
        f"`{IM_START}`, `{IM_END}`; Qwen-style chat template. Generation stops at `{EOS}` or `{IM_END}`.",
        "",
        "## Architecture",
        f"Both: {args.layers} layers, hidden {COMMON['hidden_size']}, {COMMON['num_attention_heads']} query heads / "
        f"{COMMON['num_key_value_heads']} KV heads, head_dim {COMMON['head_dim']}, untied embeddings, "
        f"init range {COMMON['initializer_range']}, float32 weights.",
        f"- `moe/`: Qwen3MoeForCausalLM, {args.experts} experts, top-{args.top_k}, moe_intermediate_size "
        f"{args.moe_width}, normalised top-k weights; trained with the load-balancing loss "
        f"(coefficient {args.aux_coef}).",
        f"- `dense/`: Qwen3ForCausalLM, intermediate_size {args.top_k * args.moe_width} (the MoE's active width).",
        "",
        "## Training",
        f"AdamW (weight decay {args.wd}), peak lr {args.lr}, warmup then cosine to 10%, {args.steps} steps x "
        f"{args.batch} rows of {args.seq_len} tokens (whole documents packed from the row start), loss on every token.",
        "",
        "| model | parameters (active) | final LM loss | mean sampled entropy (nats) | chat entropy "
        "| greedy exact answers | folder size | train+eval time |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for kind, r in (("moe", moe), ("dense", dense)):
        md.append(
            f"| {kind} | {r['params']:,} ({r['active']:,}) | {r['loss']:.3f} | {r['entropy']:.3f} | "
            f"{r['chat_entropy']:.3f} | "
            f"{r['accuracy']:.2f} | {r['size'] / 1e6:.2f} MB | {r['seconds']:.0f} s |"
        )
    md += [
        "",
        "Loss is an exponential moving average over steps and includes the (random) prompt tokens. Entropy is that of "
        "the next-token distribution at each token sampled with `generate` at temperature 1 (no top-k/top-p), on 64 "
        "held-out prompts, up to the end token; chat entropy on the 8 chat prompts. Greedy exact answers: share of "
        "held-out prompts with a unique answer that greedy decoding gets exactly right.",
        "",
        "sha256 of `model.safetensors` (the same on every run with this torch version and thread count):",
        *(f"- {kind}: `{_sha256(args.out / 'models' / kind / 'model.safetensors')}`" for kind in ("moe", "dense")),
        "",
        "## MoE expert load",
        f"Share of routed (token, slot) pairs per expert on 256 training rows (uniform = {1 / args.experts:.4f}).",
        "",
        "| layer | " + " | ".join(str(e) for e in range(args.experts)) + " |",
        "|---|" + "---|" * args.experts,
    ]
    for i, load in enumerate(moe["loads"]):
        md.append(f"| {i} | " + " | ".join(f"{x:.3f}" for x in load) + " |")
    md += ["", "## Samples (temperature 1)", ""]
    for kind, r in (("moe", moe), ("dense", dense)):
        for p, t in r["samples"]:
            md.append(f"- {kind}: `{p!r}` -> `{t!r}`")
    text = "\n".join(md) + "\n"
    (args.out / "models" / "TRAINING.md").write_text(text)


if __name__ == "__main__":
    main()
