import json
import random
import subprocess
import sys

import pytest

from tengyun.engine.detokenizer import IncrementalDetokenizer
from tengyun.sampling_params import SamplingParams

FFFD = "\ufffd"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# 龍 and 🐉 never occur in the training text, so they stay split into raw byte tokens.
RARE = ["龍", "🐉", "鳳", "🦄"]
FRAGMENTS = ["hello", " world", " the", " quick", " fox", ",", ".", " ", "你好", "世界", "我很好", "😀", "🎉",
             " streaming", " text", "!", "\n", "tokens"] + RARE


@pytest.fixture(scope="module")
def tokenizer():
    """A tiny byte-level BPE (GPT-2 / Qwen style) trained in memory: no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [
        "the quick brown fox jumps over the lazy dog. " * 3,
        "hello world, streaming text is fun!",
        "你好，世界。你好吗？我很好。",
        "emoji 😀 and 🎉 party",
        "tokenizers split bytes",
    ] * 20
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIALS,
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", clean_up_tokenization_spaces=False)


@pytest.fixture(scope="module")
def sp_tokenizer():
    """A tiny Llama-style tokenizer: Metaspace pieces with byte fallback; decoding a piece alone
    drops its leading space, so only the prompt context gets a completion's first space right."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    corpus = ["the quick brown fox jumps over the lazy dog. hello world, 你好，世界。"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=200, special_tokens=SPECIALS, show_progress=False))
    spec = json.loads(tok.to_str())
    for b in range(256):
        spec["model"]["vocab"].setdefault(f"<0x{b:02X}>", len(spec["model"]["vocab"]))
    spec["model"]["byte_fallback"] = True
    spec["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0},
    ]}
    tok = Tokenizer.from_str(json.dumps(spec))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", clean_up_tokenization_spaces=False)


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def stream(detok, ids, chunk=1):
    """Feed ids `chunk` at a time; return (stop or None, list of output_text growth per step)."""
    deltas = []
    for i in range(0, len(ids), chunk):
        before = len(detok.output_text)
        stop = detok.update(ids[i : i + chunk])
        deltas.append(detok.output_text[before:])
        if stop is not None:
            return stop, deltas
    return None, deltas


def test_fixture_splits_rare_chars_over_several_tokens(tokenizer):
    for ch in RARE:
        assert len(encode(tokenizer, ch)) >= 2, ch


def test_chinese_and_emoji_round_trip_without_replacement_char(tokenizer):
    text = "你好龍🐉世界😀 hello 鳳🦄!"
    ids = encode(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, encode(tokenizer, "prompt 龍"), SamplingParams())
    _, deltas = stream(detok, ids)
    assert all(FFFD not in d for d in deltas)
    assert "" in deltas  # some steps held a partial character back
    assert "".join(deltas) == detok.output_text == text


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_incremental_text_matches_full_decode_on_random_sequences(tokenizer, skip_special_tokens):
    rng = random.Random(0)
    for _ in range(150):
        pieces = rng.choices(FRAGMENTS + SPECIALS, k=rng.randint(1, 25))
        ids = encode(tokenizer, "".join(pieces))
        prompt = encode(tokenizer, "".join(rng.choices(FRAGMENTS, k=rng.randint(0, 8))))
        params = SamplingParams(skip_special_tokens=skip_special_tokens)
        detok = IncrementalDetokenizer(tokenizer, prompt, params)
        _, deltas = stream(detok, ids, chunk=rng.randint(1, 3))
        assert all(FFFD not in d for d in deltas)
        assert detok.output_text == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_completion_keeps_its_leading_space_after_the_prompt(sp_tokenizer):
    assert sp_tokenizer.decode(encode(sp_tokenizer, "hello world")[1:]) == "world"  # alone: space lost
    rng = random.Random(1)
    for _ in range(100):
        prompt = encode(sp_tokenizer, "".join(rng.choices(FRAGMENTS, k=rng.randint(1, 8))))
        ids = encode(sp_tokenizer, "hello" + "".join(rng.choices(FRAGMENTS, k=rng.randint(1, 20))))[1:]
        detok = IncrementalDetokenizer(sp_tokenizer, prompt, SamplingParams())
        _, deltas = stream(detok, ids, chunk=rng.randint(1, 3))
        assert all(FFFD not in d for d in deltas)
        # What the completion adds to the prompt's text.
        assert detok.output_text == sp_tokenizer.decode(prompt + ids)[len(sp_tokenizer.decode(prompt)) :]


def test_each_step_decodes_a_bounded_window(tokenizer):
    class Counting:
        def __init__(self):
            self.longest = 0

        def decode(self, ids, **kw):
            self.longest = max(self.longest, len(ids))
            return tokenizer.decode(ids, **kw)

    counting = Counting()
    ids = encode(tokenizer, " the quick fox" * 40)
    detok = IncrementalDetokenizer(counting, encode(tokenizer, "hello world" * 10), SamplingParams())
    stream(detok, ids)
    assert detok.output_text == " the quick fox" * 40
    assert counting.longest <= 8


def test_special_tokens_kept_when_not_skipped(tokenizer):
    ids = encode(tokenizer, "hello<|im_end|> world")
    kept = IncrementalDetokenizer(tokenizer, [], SamplingParams(skip_special_tokens=False))
    skipped = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    stream(kept, ids)
    stream(skipped, ids)
    assert kept.output_text == "hello<|im_end|> world"
    assert skipped.output_text == "hello world"


def test_stop_string_spanning_two_tokens_is_caught_and_excluded(tokenizer):
    ids = encode(tokenizer, "hello world the fox")
    assert [tokenizer.decode([i]) for i in ids[:2]] == ["hello", " world"]
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["lo wo"]))
    stop, _ = stream(detok, ids)
    assert stop == "lo wo"
    assert detok.output_text == "hel"


def test_include_stop_str_in_output_keeps_the_stop_and_cuts_after_it(tokenizer):
    ids = encode(tokenizer, "hello world the fox")
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["lo wo"], include_stop_str_in_output=True))
    stop, _ = stream(detok, ids)
    assert stop == "lo wo"
    assert detok.output_text == "hello wo"


def test_stop_string_made_of_split_chinese_bytes_is_caught(tokenizer):
    ids = encode(tokenizer, "你好龍🐉世界")
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["龍🐉"]))
    stop, deltas = stream(detok, ids)
    assert stop == "龍🐉" and detok.output_text == "你好"
    assert all(FFFD not in d for d in deltas)


def test_earliest_stop_string_wins(tokenizer):
    ids = encode(tokenizer, "hello world")
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["world", "llo"]))
    assert detok.update(ids) == "llo"
    assert detok.output_text == "he"


def test_no_stop_strings_means_no_stop(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    assert detok.update(encode(tokenizer, "hello world")) is None


def test_streaming_holds_back_a_possible_stop_prefix(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["STOP"]))  # hold back 3 chars
    detok.update(encode(tokenizer, "hello"))
    assert detok.get_next_output_text(finished=False, delta=True) == "he"
    assert detok.get_next_output_text(finished=False, delta=False) == "he"
    detok.update(encode(tokenizer, " world"))
    assert detok.get_next_output_text(finished=False, delta=True) == "llo wo"
    assert detok.get_next_output_text(finished=False, delta=True) == ""
    assert detok.get_next_output_text(finished=True, delta=True) == "rld"
    assert detok.get_next_output_text(finished=True, delta=False) == "hello world"


def test_streamed_deltas_never_show_part_of_a_stop_string(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["o wor"]))
    streamed = ""
    for i in encode(tokenizer, "hello world"):
        if detok.update([i]) is not None:
            streamed += detok.get_next_output_text(finished=True, delta=True)
            break
        streamed += detok.get_next_output_text(finished=False, delta=True)
    assert streamed == detok.output_text == "hell"


def test_no_hold_back_when_stop_is_included_in_output(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["STOP"], include_stop_str_in_output=True))
    detok.update(encode(tokenizer, "hello"))
    assert detok.get_next_output_text(finished=False, delta=True) == "hello"


def test_detokenize_false_produces_no_text(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(detokenize=False, stop=["hello"]))
    assert detok.update(encode(tokenizer, "hello world")) is None
    assert detok.output_text == ""
    assert detok.get_next_output_text(finished=True, delta=True) == ""


def test_detokenizer_does_not_import_torch():
    code = "import sys, tengyun.engine.detokenizer; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_fast_tokenizers_decode_through_their_backend_unless_a_subclass_overrides_decode(tokenizer, sp_tokenizer):
    """The Rust backend's decode stands in for transformers' own (the random-sequence tests above
    check its text against tokenizer.decode); a subclass's decode is honoured."""
    from tengyun.engine.detokenizer import decodes_through_backend

    assert decodes_through_backend(type(tokenizer)) and decodes_through_backend(type(sp_tokenizer))
    calls = []

    class Overriding(type(tokenizer)):
        def decode(self, ids, **kwargs):
            calls.append(list(ids))
            return super().decode(ids, **kwargs).upper()

    overriding = Overriding(tokenizer_object=tokenizer.backend_tokenizer, eos_token="<|endoftext|>")
    assert not decodes_through_backend(Overriding)
    detok = IncrementalDetokenizer(overriding, [], SamplingParams())
    stream(detok, encode(tokenizer, "hello world"))
    assert calls and detok.output_text == "HELLO WORLD"
