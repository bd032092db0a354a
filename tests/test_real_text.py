"""Real text samples: a checkpoint's chat template and tokenizer render and tokenize a manifest's
conversations as transformers' ``apply_chat_template`` does, the targets are each assistant turn's
content and end-of-turn tokens, the data profile counts exactly the tokens the backend feeds, and
`dflop run --backend torch` trains on them from the loss transformers computes. The tokenizer is a
tiny WordLevel one trained here; the checkpoint a tiny random Qwen2 that transformers saves here."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as T
import yaml
from cli_helpers import assert_one_line_error, dflop, dflop_json
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from dflop.errors import DflopError
from dflop.specs import presets
from dflop.workload.chat import ChatCounter, encode_dataset, load_chat
from dflop.workload.manifest import read_manifest

TEMPLATE = (  # Qwen2's layout, its assistant turns marked for transformers' assistant mask
    "{%- for message in messages %}{%- if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{%- else %}{{ message['content'] + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")
WORDS = ("system user assistant You are a helpful what is the cat dog sat on mat yes no why because it "
         "likes red blue sky sea tell me more about hello there fine thanks . ? ,").split()
CONVERSATIONS = [  # LLaVA's from/value (one with a system prompt) and ShareGPT's role/content, multi-turn too
    {"id": "a", "conversations": [{"from": "human", "value": "what is the cat ?"},
                                  {"from": "gpt", "value": "the cat sat on the mat ."}]},
    {"id": "b", "system_prompt": "You are a cat .", "conversations": [
        {"from": "human", "value": "hello"}, {"from": "gpt", "value": "hello there"},
        {"from": "human", "value": "why ?"}, {"from": "gpt", "value": "because it likes the sea ."}]},
    {"id": "c", "messages": [{"role": "user", "content": "tell me more about the sky"},
                             {"role": "assistant", "content": "the sky is blue , the sea is blue ."}]},
    {"id": "d", "messages": [{"role": "user", "content": "yes ?"}, {"role": "assistant", "content": "no"},
                             {"role": "user", "content": "fine"}, {"role": "assistant", "content": "thanks ."}]},
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(transformers model, transformers tokenizer, folder) of a tiny Qwen2 with its tokenizer and template."""
    folder = tmp_path_factory.mktemp("qwen2-chat")
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(WORDS)] * 2, trainers.WordLevelTrainer(
        special_tokens=["[UNK]", "<|im_start|>", "<|im_end|>"], min_frequency=1))
    fast = T.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="<|im_end|>",
                                     pad_token="[UNK]")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(folder)
    model = saved(T.Qwen2Config(vocab_size=tok.get_vocab_size(), **SIZES,
                                rope_parameters={"rope_type": "default", "rope_theta": 1e6}), folder, seed=0)
    (folder / "data.jsonl").write_text("".join(json.dumps(c) + "\n" for c in CONVERSATIONS))
    return model, fast, folder


SIZES = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256)


def saved(config, folder, seed: int):
    """A random model of ``config``, every weight moved off its initial value, saved in ``folder``."""
    torch.manual_seed(seed)
    model = T.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def llama_checkpoint(checkpoint, tmp_path_factory):
    """The same tokenizer, template and data with a tiny random Llama (an o_proj bias, tied
    embeddings, 1e-5 norms): the other LLM layout a plain checkpoint comes in."""
    import shutil

    _, fast, source = checkpoint
    folder = tmp_path_factory.mktemp("llama-chat")
    for name in ("tokenizer.json", "tokenizer_config.json", "data.jsonl"):
        shutil.copy(source / name, folder / name)
    if (source / "chat_template.jinja").exists():
        shutil.copy(source / "chat_template.jinja", folder / "chat_template.jinja")
    model = saved(T.LlamaConfig(vocab_size=len(fast), **SIZES, rms_norm_eps=1e-5, attention_bias=True,
                                tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 5e5}),
                  folder, seed=1)
    return model, fast, folder


FAMILIES = {"qwen2": "checkpoint", "llama": "llama_checkpoint"}


def messages(entry: dict) -> list[dict]:
    system = [{"role": "system", "content": entry["system_prompt"]}] if "system_prompt" in entry else []
    turns = entry.get("messages") or [{"role": {"human": "user", "gpt": "assistant"}[t["from"]], "content": t["value"]}
                                      for t in entry["conversations"]]
    return system + turns


def test_the_tokens_and_targets_are_transformers_assistant_mask(checkpoint):
    _, fast, folder = checkpoint
    chat = load_chat(folder)
    for entry in CONVERSATIONS:
        got = chat.encode(messages(entry), entry["id"])
        want = fast.apply_chat_template(messages(entry), tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
        assert got.ids.tolist() == want["input_ids"]
        assert got.targets.astype(int).tolist() == want["assistant_masks"]
        end = fast.convert_tokens_to_ids("<|im_end|>")
        assert got.targets.sum() > 0 and int((got.ids[got.targets] == end).sum()) == sum(
            m["role"] == "assistant" for m in messages(entry))


def test_the_profile_counts_exactly_the_tokens_the_backend_feeds(checkpoint):
    """The data profile's text tokens, sample by sample, are the length of the ids the launcher
    hands the ranks (and a count without the template would differ)."""
    from dflop.backends.torch_runtime.model import sample_inputs

    _, _, folder = checkpoint
    encoder = presets.encoder("tiny-vit")
    table = read_manifest(folder / "data.jsonl", encoder, tokenizer=ChatCounter(load_chat(folder))).samples
    batch = table.with_ids([f"e0:{i}" for i in table.ids])
    texts = encode_dataset(folder / "data.jsonl", encoder, load_chat(folder), [batch])[0]
    fed = [len(sample_inputs(0, str(i), 0, int(n), 28, 64, text=texts)[1]) for i, n in zip(batch.ids, batch.text_tokens)]
    assert fed == table.text_tokens.tolist() and list(texts) == list(batch.ids)
    plain = read_manifest(folder / "data.jsonl", encoder, tokenizer=folder).samples
    assert plain.text_tokens.tolist() != table.text_tokens.tolist()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_reference_loss_is_the_mean_over_assistant_targets(request, family):
    """The single-process reference on real samples computes transformers' masked mean, on a Qwen2
    and on a Llama checkpoint."""
    checkpoint = request.getfixturevalue(FAMILIES[family])
    from dflop.backends.torch_runtime.reference import reference_training
    from dflop.backends.torch_runtime.worker import TorchOptions
    from dflop.specs.models import MLLMSpec
    from dflop.specs.hf_config import llm_from_hf_config

    model, fast, folder = checkpoint
    encoder = presets.encoder("tiny-vit")
    table = read_manifest(folder / "data.jsonl", encoder, tokenizer=ChatCounter(load_chat(folder))).samples
    texts = encode_dataset(folder / "data.jsonl", encoder, load_chat(folder), [table])
    spec = MLLMSpec(encoder=encoder, llm=llm_from_hf_config(folder / "config.json"))
    ref = reference_training(spec, [table], TorchOptions(weights=str(folder), lr=1e-3), texts)
    assert ref.losses[0] == pytest.approx(transformers_loss(model, fast, [c["id"] for c in CONVERSATIONS]), rel=1e-4)


def transformers_loss(model, fast, ids: list[str]) -> float:
    """The token-weighted mean over the samples' assistant targets, as transformers computes it."""
    total, count = 0.0, 0
    by_id = {c["id"]: c for c in CONVERSATIONS}
    with torch.no_grad():
        for i in ids:
            enc = fast.apply_chat_template(messages(by_id[i]), tokenize=True, return_dict=True,
                                           return_assistant_tokens_mask=True)
            ids_ = torch.tensor(enc["input_ids"])[None]
            labels = torch.where(torch.tensor(enc["assistant_masks"], dtype=torch.bool)[None], ids_, -100)
            n = int((labels[0, 1:] != -100).sum())
            total += float(model(input_ids=ids_, labels=labels).loss) * n
            count += n
    return total / count


def run_config(folder, **data) -> dict:
    return {"model": {"checkpoint": "."}, "encoder": "tiny-vit",
            "cluster": {"hardware": "cpu", "nodes": 1, "gpus_per_node": 2}, "training": {"global_batch": 2},
            "data": {"dataset": "data.jsonl", **data}, "steps": 2,
            "plan": {"encoder": {"dp": 2}, "llm": {"dp": 2}, "placement": "colocated", "microbatches": 1},
            "execution": {"lr": 1e-3}}


@pytest.mark.processes
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_torch_run_trains_on_the_samples_from_transformers_loss(request, tmp_path, family):
    model, fast, folder = request.getfixturevalue(FAMILIES[family])
    path = folder / "real.yaml"
    path.write_text(yaml.safe_dump(run_config(folder)))
    r = dflop_json("run", "--backend", "torch", "--config", path, "--out", tmp_path / "out")
    assert r["inputs"].startswith("real samples") and "chat template" in r["data"]
    for arm in (r, r["baseline"]):
        first, second = arm["trained"]
        assert [s["loss"] for s in arm["trained"]] == arm["losses"]
        ids = [i.split(":", 1)[1] for i in first["sample_ids"] + second["sample_ids"]]
        assert len(first["sample_ids"]) == 2 and sorted(ids) == sorted(c["id"] for c in CONVERSATIONS)
        steps = json.loads((tmp_path / "out" / "schedules" / ("dflop" if arm is r else "baseline")
                            / "step-000000.json").read_text())
        assert json.dumps(steps).count('"' + first["sample_ids"][0] + '"') >= 1
        want = transformers_loss(model, fast, [i.split(":", 1)[1] for i in first["sample_ids"]])
        assert first["loss"] == pytest.approx(want, rel=1e-4)


@pytest.mark.processes
def test_a_synthetic_run_says_so(checkpoint, tmp_path):
    _, _, folder = checkpoint
    path = folder / "synthetic.yaml"
    path.write_text(yaml.safe_dump(run_config(folder, synthetic=True)))
    r = dflop_json("run", "--backend", "torch", "--config", path, "--out", tmp_path / "out")
    assert r["inputs"].startswith("synthetic") and r["baseline"]["inputs"].startswith("synthetic")
    assert "chat template" not in r["data"]


@pytest.mark.parametrize("change, message", [
    (lambda f: (f / "tokenizer.json").unlink(), r"tokenizer\.json: tokenizer not found"),
    (lambda f: f.joinpath("tokenizer_config.json").write_text(json.dumps(
        {**json.loads(f.joinpath("tokenizer_config.json").read_text()),
         "chat_template": "{{ raise_exception('no system turns') }}"})), r"data\.jsonl:1: .*no system turns"),
    (lambda f: f.joinpath("tokenizer_config.json").write_text(json.dumps(
        {**json.loads(f.joinpath("tokenizer_config.json").read_text()), "chat_template": "{% for %}"})),
     r"chat template, line 1:"),
])
def test_bad_input_is_one_line(checkpoint, tmp_path, change, message):
    import shutil

    _, _, folder = checkpoint
    copy = tmp_path / "ckpt"
    shutil.copytree(folder, copy)
    (copy / "chat_template.jinja").unlink(missing_ok=True)
    change(copy)
    with pytest.raises(DflopError, match=message):
        read_manifest(copy / "data.jsonl", presets.encoder("tiny-vit"), tokenizer=ChatCounter(load_chat(copy)))


@pytest.mark.processes
@pytest.mark.parametrize("change, message", [
    (lambda f: (f / "data.jsonl").write_text(json.dumps({"id": "x", "messages": [{"role": "robot", "content": "hi"}]})),
     "data.jsonl:1: entry 0: turn 0: role 'robot' is not one of"),
    (lambda f: (f / "tokenizer.json").unlink(), "tokenizer.json: tokenizer not found"),
])
def test_bad_input_stops_the_run_with_one_line(checkpoint, tmp_path, change, message):
    import shutil

    _, _, folder = checkpoint
    copy = tmp_path / "ckpt"
    shutil.copytree(folder, copy)
    change(copy)
    path = copy / "real.yaml"
    path.write_text(yaml.safe_dump(run_config(copy)))
    result = dflop("run", "--backend", "torch", "--config", path, "--out", tmp_path / "out")
    assert_one_line_error(result, message)
