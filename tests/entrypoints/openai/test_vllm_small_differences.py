"""Small differences a vLLM client sees, each as vLLM 0.11 answers: chat `"logprobs": "true"`
(a string) read as true by the request model, `"prompt_logprobs": true` read as 1,
`--reasoning-parser deepseek_r1` (the output starts inside the reasoning), whole and streamed at
every split."""

from __future__ import annotations

import argparse

import pytest

from tengyun.entrypoints.openai.chat_output import ChoiceOutputParser
from tengyun.entrypoints.openai.cli_args import make_arg_parser, server_config_from_args
from tengyun.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from tengyun.entrypoints.openai.reasoning_parsers import DeepSeekR1ReasoningParser, get_reasoning_parser

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("value, expected", [("true", True), ("false", False), (1, True), (True, True)])
def test_chat_logprobs_is_read_as_vllms_lax_model_reads_it(value, expected):
    request = ChatCompletionRequest.model_validate({"messages": MESSAGES, "logprobs": value, "top_logprobs": 0})
    assert request.logprobs is expected


def test_chat_logprobs_that_is_no_boolean_is_still_refused():
    with pytest.raises(ValueError, match="logprobs"):
        ChatCompletionRequest.model_validate({"messages": MESSAGES, "logprobs": "maybe"})


@pytest.mark.parametrize("value, expected", [(True, 1), (False, 0), ("3", 3), (2, 2)])
def test_prompt_logprobs_is_read_as_vllms_lax_model_reads_it(value, expected):
    request = CompletionRequest.model_validate({"prompt": "hi", "prompt_logprobs": value})
    assert request.prompt_logprobs == expected


def test_other_fields_stay_strict():
    with pytest.raises(ValueError, match="stream"):
        ChatCompletionRequest.model_validate({"messages": MESSAGES, "stream": "true"})


def test_deepseek_r1_is_a_reasoning_parser_flag_value():
    args = make_arg_parser(argparse.ArgumentParser()).parse_args(["model", "--reasoning-parser", "deepseek_r1"])
    assert server_config_from_args(args).reasoning_parser == "deepseek_r1"
    assert get_reasoning_parser("deepseek_r1") is DeepSeekR1ReasoningParser


# (text, reasoning, content): whatever the prompt holds, the output is reasoning until </think>
R1_CASES = [
    ("<think>\nPlan it.\n</think>\n\nThe answer.", "Plan it.", "The answer."),
    ("Plan it.\n</think>\n\nThe answer.", "Plan it.", "The answer."),
    ("Plan it, cut by max_tokens", "Plan it, cut by max_tokens", ""),
    ("<think>Plan </thi", "Plan </thi", ""),
]


@pytest.mark.parametrize("text, reasoning, content", R1_CASES)
def test_deepseek_r1_whole_and_streamed_at_every_split(text, reasoning, content):
    r1 = DeepSeekR1ReasoningParser()
    assert r1.prompt_opens_reasoning("<｜Assistant｜>")
    parsed = ChoiceOutputParser(r1, None, in_reasoning=True).parse(text)
    assert (parsed.reasoning, parsed.content) == (reasoning, content)
    for chunks in [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]:
        parser, got_reasoning, got_content = ChoiceOutputParser(DeepSeekR1ReasoningParser(), None, True), "", ""
        for k, chunk in enumerate(chunks):
            delta = parser.add(chunk, finished=k == len(chunks) - 1)
            got_reasoning += delta.reasoning or ""
            got_content += delta.content
        assert (got_reasoning, got_content) == (reasoning, content), chunks
