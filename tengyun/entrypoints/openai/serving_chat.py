"""POST /v1/chat/completions: the chat template renders the messages, then one engine request."""

from __future__ import annotations

import time
from typing import AsyncIterator

from tengyun.entrypoints.openai.protocol import (
    ChatCompletionLogProb, ChatCompletionLogProbs, ChatCompletionLogProbsContent, ChatCompletionRequest,
    ChatCompletionResponse, ChatCompletionResponseChoice, ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse, ChatResponseMessage, DeltaMessage, UsageInfo, random_id,
)
from tengyun.entrypoints.openai.serving_engine import SSE_DONE, OpenAIServing, sse, sse_error
from tengyun.outputs import RequestOutput


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(
            self, request: ChatCompletionRequest) -> ChatCompletionResponse | AsyncIterator[str]:
        """Validates everything before the first engine call: bad input raises RequestError."""
        self.check_model(request.model)
        text = self.render_chat(request.messages, request.add_generation_prompt, request.continue_final_message,
                                request.chat_template, request.chat_template_kwargs)
        # The template already holds BOS and friends: do not add special tokens twice.
        token_ids = self.tokenizer.encode(text, add_special_tokens=False)
        max_tokens = request.requested_max_tokens
        self.check_length(len(token_ids), max_tokens, "messages")
        params = request.to_sampling_params(max_tokens)
        request_id = random_id("chatcmpl")
        stream = self.engine.generate(request_id, token_ids, params)
        if request.stream:
            return self._stream(request, request_id, stream)
        return await self._full(request, request_id, stream)

    async def _full(self, request: ChatCompletionRequest, request_id: str, stream) -> ChatCompletionResponse:
        final: RequestOutput | None = None
        async for _, output in self.merged([stream]):
            final = output
        choices = []
        for c in final.outputs:
            logprobs = None
            if request.logprobs:
                logprobs = chat_logprobs(c.token_ids, c.logprobs or [], request.top_logprobs or 0)
            choices.append(ChatCompletionResponseChoice(
                index=c.index, message=ChatResponseMessage(content=c.text), logprobs=logprobs,
                finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        prompt = len(final.prompt_token_ids)
        completion = sum(len(c.token_ids) for c in final.outputs)
        usage = UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
        return ChatCompletionResponse(id=request_id, model=self.served_model_name, choices=choices, usage=usage)

    async def _stream(self, request: ChatCompletionRequest, request_id: str, stream) -> AsyncIterator[str]:
        created, n = int(time.time()), request.n
        sent_chars, sent_tokens, done = [0] * n, [0] * n, [False] * n
        exclude = None if request.include_usage_in_stream else {"usage"}
        prompt_tokens = 0

        def chunk(choices: list[ChatCompletionResponseStreamChoice]) -> str:
            response = ChatCompletionStreamResponse(id=request_id, created=created, model=self.served_model_name,
                                                    choices=choices)
            return sse(response.model_dump(exclude=exclude))

        try:
            # The role first, as OpenAI does, before the engine produced anything.
            yield chunk([ChatCompletionResponseStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                         for i in range(n)])
            async for _, output in self.merged([stream]):
                prompt_tokens = len(output.prompt_token_ids)
                choices = []
                for c in output.outputs:
                    if done[c.index]:
                        continue
                    delta = c.text[sent_chars[c.index]:]
                    new_tokens = c.token_ids[sent_tokens[c.index]:]
                    if not delta and c.finish_reason is None and not (request.logprobs and new_tokens):
                        continue
                    logprobs = None
                    if request.logprobs:
                        logprobs = chat_logprobs(new_tokens, (c.logprobs or [])[sent_tokens[c.index]:],
                                                 request.top_logprobs or 0)
                    sent_chars[c.index], sent_tokens[c.index] = len(c.text), len(c.token_ids)
                    done[c.index] = c.finish_reason is not None
                    choices.append(ChatCompletionResponseStreamChoice(
                        index=c.index, delta=DeltaMessage(content=delta) if delta else DeltaMessage(),
                        logprobs=logprobs, finish_reason=c.finish_reason, stop_reason=c.stop_reason))
                if choices:
                    yield chunk(choices)
            if request.include_usage_in_stream:
                completion = sum(sent_tokens)
                usage = UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion,
                                  total_tokens=prompt_tokens + completion)
                response = ChatCompletionStreamResponse(id=request_id, created=created,
                                                        model=self.served_model_name, choices=[], usage=usage)
                yield sse(response.model_dump())
        except Exception as e:
            yield sse_error(e)
        yield SSE_DONE


def chat_logprobs(token_ids: list[int], logprobs: list[dict], k: int) -> ChatCompletionLogProbs:
    """Per sampled token: its logprob and the k most likely tokens, by rank."""
    content = []
    for token_id, entry in zip(token_ids, logprobs):
        sampled = entry[token_id]
        top = sorted((lp for lp in entry.values() if lp.rank is not None and lp.rank <= k), key=lambda lp: lp.rank)
        content.append(ChatCompletionLogProbsContent(
            token=sampled.decoded_token or "", logprob=sampled.logprob,
            bytes=list((sampled.decoded_token or "").encode("utf-8")),
            top_logprobs=[ChatCompletionLogProb(token=lp.decoded_token or "", logprob=lp.logprob,
                                                bytes=list((lp.decoded_token or "").encode("utf-8")))
                          for lp in top[:k]]))
    return ChatCompletionLogProbs(content=content)
