"""From engine-core outputs (token ids) to user outputs (text, logprobs, finish reasons).

Runs beside the user-facing API: detokenizes incrementally, applies stop strings (the
stop string and what follows are cut from the text, as vLLM does) and tells the caller
which requests a stop string ended so the core can free them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cluster.engine.detokenizer import IncrementalDetokenizer
from cluster.engine.messages import EngineCoreOutput, TokenLogprobs
from cluster.outputs import CompletionOutput, Logprob
from cluster.sampling_params import SamplingParams


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    text: str = ""  # text with stop strings applied
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def completion(self, index: int = 0, streaming_holdback: int = 0) -> CompletionOutput:
        """This sequence as choice `index` of its request's output."""
        text = self.text
        if streaming_holdback and self.finish_reason is None:
            # Do not show what may become the beginning of a stop string.
            text = text[: max(0, len(text) - streaming_holdback)]
        return CompletionOutput(
            index=index,
            text=text,
            token_ids=list(self.token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens,
        )


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def track(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
    ) -> RequestState:
        state = self.states[request_id] = RequestState(
            request_id,
            prompt,
            prompt_token_ids,
            params,
            IncrementalDetokenizer(self.tokenizer, prompt_token_ids),
            logprobs=[] if params.logprobs is not None else None,
            cumulative_logprob=0.0 if params.logprobs is not None else None,
        )
        return state

    def process(
        self, core_outputs: list[EngineCoreOutput]
    ) -> tuple[list[RequestState], list[tuple[str, str]]]:
        """Apply one step's outputs. Returns the updated states and `(request_id, stop)` for
        requests a stop string ended (the caller tells the core to free them)."""
        updated: list[RequestState] = []
        stopped: list[tuple[str, str]] = []
        for out in core_outputs:
            state = self.states.get(out.req_id)
            if state is None:
                continue
            state.token_ids.extend(out.new_token_ids)
            state.num_draft_tokens += out.num_draft_tokens
            state.num_accepted_tokens += out.num_accepted_tokens
            if state.logprobs is not None and out.new_logprobs:
                self._add_logprobs(state, out.new_logprobs)
            if out.prompt_logprobs is not None:
                state.prompt_logprobs = [None] + [self._entry(t) for t in out.prompt_logprobs]
            delta = state.detokenizer.add_tokens(out.new_token_ids)
            state.text += delta
            stop = self._find_stop(state, len(delta))
            if stop is not None and state.finish_reason is None:
                state.finish_reason, state.stop_reason = "stop", stop
                stopped.append((state.request_id, stop))
            elif out.finish_reason is not None:
                state.finish_reason, state.stop_reason = out.finish_reason, out.stop_reason
            updated.append(state)
            if state.finish_reason is not None:
                del self.states[out.req_id]
        return updated, stopped

    def abort(self, request_id: str) -> RequestState | None:
        state = self.states.pop(request_id, None)
        if state is not None and state.finish_reason is None:
            state.finish_reason = "abort"
        return state

    def _find_stop(self, state: RequestState, delta_len: int) -> str | None:
        """Cut the text at the first stop string that the new text completes (none before
        `min_tokens` outputs exist)."""
        if not state.params.stop or not delta_len:
            return None
        if len(state.token_ids) < state.params.min_tokens:
            return None
        longest = max(len(s) for s in state.params.stop)
        search_from = max(0, len(state.text) - delta_len - longest + 1)
        hits = [(state.text.find(s, search_from), s) for s in state.params.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return None
        index, stop = min(hits)
        state.text = state.text[:index]
        return stop

    def _add_logprobs(self, state: RequestState, tokens: list[TokenLogprobs]) -> None:
        assert state.logprobs is not None and state.cumulative_logprob is not None
        for t in tokens:
            state.logprobs.append(self._entry(t))
            state.cumulative_logprob += t.logprobs[0]

    def _entry(self, t: TokenLogprobs) -> dict[int, Logprob]:
        """token id -> Logprob for one position: the token itself (its rank), then the
        top-n (rank 1..n; the token itself appears once)."""
        entry = {}
        for rank_index, (token_id, value) in enumerate(zip(t.token_ids, t.logprobs, strict=True)):
            if token_id < 0 or token_id in entry:
                continue
            rank = t.rank if rank_index == 0 else rank_index
            entry[token_id] = Logprob(
                logprob=value, rank=rank, decoded_token=self.tokenizer.decode([token_id])
            )
        return entry
