"""POST /score (/v1/score) and /rerank (/v1/rerank, /v2/rerank), as vLLM scores pairs:

    classifier (a cross-encoder, e.g. Qwen3-Reranker converted with --hf-overrides): each pair is
        one prompt, the tokenizer's pair encoding of (text_1, text_2); the score is its first label
    embedding model: each distinct text embedded once; the score is the cosine similarity

/score pairs one text_1 with every text_2, or the i-th with the i-th; /rerank scores the query
against each document and answers them best first (top_n of them; 0: all).
"""

from __future__ import annotations

from tengyun.entrypoints.llm_pooling import score_pairs
from tengyun.entrypoints.openai.pooling_protocol import (
    RerankDocument, RerankRequest, RerankResponse, RerankResult, RerankUsage, ScoreRequest, ScoreResponse,
    ScoreResponseData,
)
from tengyun.entrypoints.openai.protocol import UsageInfo
from tengyun.entrypoints.openai.request_model import RequestError
from tengyun.entrypoints.openai.serving_pooling import OpenAIServingPooling, require_runner
from tengyun.pooling_params import PoolingParams


class OpenAIServingScore(OpenAIServingPooling):
    async def create_score(self, request: ScoreRequest) -> ScoreResponse:
        self.check_model(request.model)
        request_id = self.response_id("score", request)
        scores, tokens = await self.score_pairs(request_id, request, request.text_1, request.text_2, "text_2")
        data = [ScoreResponseData(index=i, score=s) for i, s in enumerate(scores)]
        return ScoreResponse(id=request_id, model=self.served_model_name, data=data,
                             usage=UsageInfo(prompt_tokens=tokens, total_tokens=tokens))

    async def create_rerank(self, request: RerankRequest) -> RerankResponse:
        self.check_model(request.model)
        request_id = self.response_id("rerank", request)
        scores, tokens = await self.score_pairs(request_id, request, request.query, request.documents, "documents")
        order = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)
        top_n = request.top_n if 0 < request.top_n < len(order) else len(order)
        results = [RerankResult(index=i, relevance_score=scores[i],
                                document=RerankDocument(text=request.documents[i]) if request.return_documents
                                else None) for i in order[:top_n]]
        return RerankResponse(id=request_id, model=self.served_model_name, usage=RerankUsage(total_tokens=tokens),
                              results=results)

    async def score_pairs(self, request_id: str, request: ScoreRequest | RerankRequest, first: str | list[str],
                          second: str | list[str], field: str) -> tuple[list[float], int]:
        """(score per pair, prompt tokens run)."""
        require_runner(self.engine.config, "pooling")
        pooling = self.engine.config.pooling
        if not (pooling.convert == "embed" or (pooling.convert == "classify" and pooling.num_labels == 1)):
            api = "Score" if field == "text_2" else "Rerank"
            raise RequestError(f"The model does not support {api} API: a score is one number, and this model is "
                               f"{pooling.describe()}; serve a one-label cross-encoder (a reranker) or an "
                               f"embedding model, or use /classify.")
        try:
            pairs = score_pairs(first, second)
        except ValueError as e:
            raise RequestError(str(e), field) from None
        activation = next((v for v in (request.activation, request.softmax) if v is not None), None)
        if pooling.convert == "embed":
            return await self._cosine_scores(request_id, request, pairs, field, activation)
        params = PoolingParams(task="score", truncate_prompt_tokens=request.truncate_prompt_tokens,
                               activation=activation)
        prompts = [await self.worker.run(self._pair_ids, a, b, request.add_special_tokens) for a, b in pairs]
        outputs = await self.pool(request_id, prompts, [params] * len(prompts), request.add_special_tokens, field)
        return [float(o.outputs.data[0]) for o in outputs], sum(len(o.prompt_token_ids) for o in outputs)

    async def _cosine_scores(self, request_id: str, request: ScoreRequest | RerankRequest,
                             pairs: list[tuple[str, str]], field: str,
                             activation: bool | None) -> tuple[list[float], int]:
        """An embedding model's scores; ``activation`` (a cross-encoder's field) is refused by the embed
        task's check, in vLLM's words, as vLLM refuses it."""
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))
        params = PoolingParams(task="embed", truncate_prompt_tokens=request.truncate_prompt_tokens,
                               activation=activation)
        outputs = await self.pool(request_id, texts, [params] * len(texts), request.add_special_tokens, field)
        vectors = {text: list(o.outputs.data) for text, o in zip(texts, outputs)}
        return [_cosine(vectors[a], vectors[b]) for a, b in pairs], sum(len(o.prompt_token_ids) for o in outputs)

    def _pair_ids(self, first: str, second: str, add_special_tokens: bool) -> list[int]:
        """The tokenizer's encoding of the pair (its pair template, or the two encodings joined)."""
        return self.tokenizer(text=first, text_pair=second, add_special_tokens=add_special_tokens)["input_ids"]


def _cosine(x: list[float], y: list[float]) -> float:
    dot = sum(p * q for p, q in zip(x, y))
    norm = (sum(p * p for p in x) ** 0.5) * (sum(q * q for q in y) ** 0.5)
    return dot / max(norm, 1e-12)
