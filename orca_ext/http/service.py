"""The HTTP layer's per-app state and the steps every completion request goes through.

`Service` holds the app's configuration and its admissions; `Admission` is one request's place
in the --max-queue budget. The checks that run before admission (auth, content type, body size
and time, model name) never touch the engine, so malformed or oversize input costs no engine
work.

Prompts: chat templates are rendered and text prompts encoded on `PromptWorkers` threads
(prompt_workers.py), a bounded pool shared fairly between clients (client_key), never on the
event loop, the engine's thread or under its lock; the chat limits are checked before that, on
the event loop, in time proportional to the number of messages (chat_prompt.py).

Shutdown: drain() stops admitting (503), lets admitted requests finish for a bounded grace
period, then aborts the rest, which end with an in-band error event (streams, see sse.py) or a
503 (non-streaming).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections import Counter
from typing import Any, Callable, Iterator, Sequence

from fastapi import Request
from pydantic import ValidationError

from ..chat_prompt import ChatPromptEncoder
from ..errors import EngineDeadError, InvalidRequestError, ServerClosedError
from ..guided import CompiledGrammar, GrammarCompiler, llg_tokenizer
from ..prefix_cache import common_prefix
from ..sampling import SamplingParams
from ..server import Server
from ..validation import text_prompt_ids
from . import protocol
from .errors import APIError, bad_request
from .guards import bearer_ok
from .log_every import RequestLogs
from .logprob_fields import TokenTexts, chat_logprobs, completion_logprobs
from .metrics import Metrics
from .prompt_workers import DEFAULT_PROMPT_JOBS_PER_CLIENT, DEFAULT_PROMPT_THREADS, PromptWorkers
from .rejections import RejectionBudget
from .settings import DEFAULT_BODY_TIMEOUT

logger = logging.getLogger(__name__)

GRAMMAR_THREADS = 2
GRAMMAR_NICE = 19   # lowest priority: see prompt_workers.lower_thread_priority


def default_max_queue_per_client(max_queue: int) -> int:
    """--max-queue-per-client by default: three quarters of --max-queue (at least 1), so that the
    last quarter is always there for the other clients."""
    return max(1, max_queue * 3 // 4)


def validation_error(exc: ValidationError) -> APIError:
    """First pydantic error as a 400 naming the field (dotted path, e.g. messages.0.role)."""
    err = exc.errors(include_url=False)[0]
    loc = ".".join(str(p) for p in err.get("loc", ()))
    if err["type"] == "json_invalid":
        return bad_request(f"Malformed JSON body: {err.get('ctx', {}).get('error', err['msg'])}",
                           code="invalid_json")
    if err["type"] == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {loc}", param=loc)
    if err["type"] == "model_type" and not loc:
        return bad_request("The request body must be a JSON object", code="invalid_json")
    if err["type"] == "missing":
        return bad_request(f"Missing required parameter: {loc}", param=loc)
    msg = err["msg"].removeprefix("Value error, ")
    return bad_request(msg if loc and msg.startswith(loc) else f"{loc}: {msg}", param=loc or None)


class Admission:
    """One admitted request's hold on the queue; closing is idempotent (stream end, disconnect,
    error paths may all try)."""

    def __init__(self, service: "Service", rid: str, endpoint: str, client: str, weight: int = 1) -> None:
        self.service = service
        self.rid = rid
        self.endpoint = endpoint
        self.client = client
        self.weight = weight    # its places in --max-queue: one per prompt
        self.submitted = False
        self.finished = False
        self.shutdown = False   # ended by the server's drain, not by the client or the engine
        self._closed = False
        # Engine request ids of its sequences, prompt by prompt (n / best_of > 1 or a batch of
        # prompts: rid, rid-1, rid-2, ...; sequence k is prompt k // per_prompt's), and their
        # final outputs in that order once collected.
        self.seq_rids: list[str] = [rid]
        self.per_prompt = 1
        self.outputs: list[Any] = []

    def prompt_index(self, k: int) -> int:
        """The prompt that sequence k of the request continues."""
        return k // self.per_prompt

    def seq_rid(self, prompt: int, sequence: int = 0) -> str:
        """The engine request id of a prompt's sequence."""
        k = prompt * self.per_prompt + sequence
        return self.rid if k == 0 else f"{self.rid}-{k}"

    def seq_index(self, rid: str) -> int:
        """k of one of this request's engine request ids (seq_rid's inverse)."""
        return 0 if rid == self.rid else int(rid.rsplit("-", 1)[1])

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.service.admissions.pop(self.rid, None)
        self.service.inflight -= self.weight
        held = self.service.queued_by_client
        held[self.client] -= self.weight
        if held[self.client] <= 0:
            del held[self.client]   # the table holds only clients with requests in flight
        self.service.metrics.inflight.set(self.service.inflight)
        if self.submitted and not self.finished:
            # The client is gone (or we failed): free the slab now, not when max_tokens is reached.
            server = self.service.server
            self.service.metrics.observe_rejected(self.endpoint, "shutdown" if self.shutdown else "abort")
            for rid in self.seq_rids:
                try:
                    aborted = server.abort(rid)
                    self.service.logs.aborted.log("request %s aborted (client disconnected or failed; was live: %s)",
                                                  rid, aborted)
                    # Collect the final output so the server releases the id now instead of keeping
                    # an undelivered output around (abort() finishes the request synchronously).
                    server.result(rid, timeout=0)
                except (KeyError, TimeoutError):
                    pass
                except Exception:  # cleanup runs in finally blocks: never mask the original error
                    logger.exception("request %s: abort failed", rid)


class Service:
    def __init__(self, server: Server, *, model_name: str, max_queue: int, max_queue_per_client: int | None,
                 api_key: str | None,
                 max_body_bytes: int, default_max_tokens: int,
                 body_timeout: float = DEFAULT_BODY_TIMEOUT, rejections: RejectionBudget | None = None,
                 prompt_threads: int = DEFAULT_PROMPT_THREADS,
                 prompt_jobs_per_client: int = DEFAULT_PROMPT_JOBS_PER_CLIENT) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1 (got {max_queue})")
        if max_queue_per_client is None:
            max_queue_per_client = default_max_queue_per_client(max_queue)
        if max_queue_per_client < 1:
            raise ValueError(f"max_queue_per_client must be >= 1 (got {max_queue_per_client})")
        if not body_timeout > 0:
            raise ValueError(f"body_timeout must be > 0 seconds (got {body_timeout})")
        self.server = server
        self.model_name = model_name
        self.max_queue = max_queue
        self.max_queue_per_client = min(max_queue_per_client, max_queue)
        self.queued_by_client: Counter[str] = Counter()   # places in --max-queue held, per client
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.default_max_tokens = default_max_tokens
        self.body_timeout = body_timeout
        self.rejections = rejections if rejections is not None else RejectionBudget()
        self.created = protocol.now()
        self.inflight = 0
        self.admissions: dict[str, Admission] = {}
        self.draining = False    # no new admissions
        self.cutting = False     # the grace period is over: whatever is still admitted is aborted
        self.metrics = Metrics(server.stats)
        self.logs = RequestLogs()  # what clients can repeat is logged at most once per 10 s per kind
        self.prompt_workers = PromptWorkers(prompt_threads, prompt_jobs_per_client)
        # Structured outputs: grammars compile on threads of their own, shared fairly between clients
        # like the prompt threads, so a slow schema delays neither prompts nor the engine; at the
        # lowest CPU priority, so a stream of fresh schemas takes only the cycles the forward leaves.
        self.grammar_workers = PromptWorkers(GRAMMAR_THREADS, 1, nice=GRAMMAR_NICE, name="orca-grammars")
        self.grammars = (GrammarCompiler(lambda: llg_tokenizer(server.tokenizer, server.eos_token_ids,
                                                               server.vocab_size))
                         if server.tokenizer is not None else None)
        encoder = server.prompt_encoder
        self.chat = ChatPromptEncoder(server.tokenizer, encoder) if encoder is not None else None
        self.parse_bounds = protocol.ParseBounds(self.chat.check_count if self.chat is not None else None)
        self._token_texts: TokenTexts | None = None

    def model_card(self) -> dict:
        return protocol.model_card(self.model_name, self.created, self.server.max_model_len,
                                   self.server.vocab_size)

    # -- checks before admission -------------------------------------------------------------

    def check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        if not bearer_ok(request.headers.get("authorization", ""), self.api_key):
            raise APIError(401, "Invalid or missing API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    @staticmethod
    def check_content_type(request: Request) -> None:
        """POST bodies must be declared JSON. A browser sends a cross-origin application/json
        POST only after a CORS preflight, so this also stops cross-site form and text posts."""
        declared = request.headers.get("content-type", "")
        if declared.split(";", 1)[0].strip().lower() != "application/json":
            raise APIError(415, f"Content-Type must be application/json (got {declared[:60]!r})",
                           code="unsupported_media_type")

    async def read_body(self, request: Request) -> bytes:
        """The body, within --max-body-bytes (413) and --body-timeout (408). A client that
        disconnects meanwhile raises starlette's ClientDisconnect. request.state.body_bytes
        counts what was read (the cost a rejection charges to the client)."""
        limit = self.max_body_bytes
        declared = request.headers.get("content-length")
        # Connection: close, so the rest of an oversize body is never read.
        too_big = APIError(413, f"Request body over the limit of {limit} bytes", code="request_too_large",
                           headers={"Connection": "close"})
        request.state.body_bytes = 0
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise too_big  # refused unread: a declared size costs the client nothing by itself

        async def read() -> bytes:
            chunks = []
            async for chunk in request.stream():
                request.state.body_bytes += len(chunk)
                if request.state.body_bytes > limit:  # chunked uploads declare no length
                    raise too_big
                chunks.append(chunk)
            return b"".join(chunks)

        try:
            return await asyncio.wait_for(read(), self.body_timeout)
        except asyncio.TimeoutError:
            raise APIError(408, f"Request body not received within {self.body_timeout:g} s",
                           code="request_timeout", headers={"Connection": "close"}) from None

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"The model {name[:200]!r} does not exist; this server serves "
                           f"{self.model_name!r}", param="model", code="model_not_found")

    def admit(self, rid: str, endpoint: str, client: str, prompts: int = 1) -> Admission:
        """Places in --max-queue for `client`'s request of `prompts` prompts (a completions batch
        counts as that many requests), within the client's --max-queue-per-client, so that one
        client never fills the queue that the others need too."""
        if self.draining:
            raise APIError(503, "The server is shutting down", code="server_shutting_down",
                           headers={"Retry-After": "5", "Connection": "close"})
        own_limit = self.max_queue_per_client
        if prompts > own_limit:
            raise bad_request(f"prompt: a batch of {prompts} prompts is over the {own_limit} requests one client "
                              f"may have in flight (--max-queue-per-client)", "prompt")
        if self.inflight + prompts > self.max_queue:
            raise APIError(429, f"Server busy: {self.inflight} requests in flight (limit --max-queue "
                           f"{self.max_queue}); retry later", code="queue_full", headers={"Retry-After": "1"})
        held = self.queued_by_client[client]
        if held + prompts > own_limit:
            raise APIError(429, f"Too many requests in flight from this client: {held} (limit "
                           f"--max-queue-per-client {own_limit}); retry later", code="client_queue_full",
                           headers={"Retry-After": "1"})
        self.inflight += prompts
        self.queued_by_client[client] += prompts
        self.metrics.inflight.set(self.inflight)
        adm = Admission(self, rid, endpoint, client, prompts)
        self.admissions[rid] = adm
        return adm

    async def drain(self, grace: float, hurry: Callable[[], bool] = lambda: False) -> None:
        """Stop admitting; give admitted requests up to `grace` seconds to finish (less if
        `hurry()` turns True); then abort the rest."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        if self.inflight:
            logger.info("draining: %d request(s) in flight get up to %g s to finish", self.inflight, grace)
        while self.inflight and loop.time() < deadline and not hurry():
            await asyncio.sleep(0.05)
        self.cutting = True
        cut = [adm for adm in list(self.admissions.values()) if not adm.finished]
        for adm in cut:
            self.cut(adm)
        if cut:
            logger.info("draining: ended %d request(s) still running after the grace period", len(cut))
        # Give the aborted requests' responses a moment to send their last events.
        end = loop.time() + 5.0
        while self.inflight and loop.time() < end and not hurry():
            await asyncio.sleep(0.02)

    def cut(self, adm: Admission) -> None:
        """End one admitted request because the server is going away."""
        adm.shutdown = True
        if adm.submitted:
            for rid in adm.seq_rids:
                self.server.abort(rid)

    @staticmethod
    def worst(outputs: list[Any]) -> Any:
        """The output a whole response stands or falls with: an error, else an abort, else the
        first sequence's."""
        return next((o for o in outputs if o.finish_reason == "error"),
                    next((o for o in outputs if o.finish_reason == "abort"), outputs[0]))

    def observe_finished(self, adm: Admission, outputs: list[Any]) -> None:
        """Metrics of a request whose sequences all finished, with their final outputs."""
        worst = self.worst(outputs)
        if worst.finish_reason == "abort" and adm.shutdown:
            self.metrics.observe_rejected(adm.endpoint, "shutdown")
        else:
            self.metrics.observe_finished(adm.endpoint, worst.finish_reason, outputs, adm.per_prompt)

    # -- prompts --------------------------------------------------------------------------------

    async def chat_prompt_ids(self, client: str, messages: list[dict[str, Any]],
                              tools: list[dict] | None = None) -> list[int]:
        """Token ids of the rendered chat; InvalidRequestError (param "messages") for messages
        over the limits (checked here, before any rendering), refused by the template, not valid
        Unicode or too long to fit. Rendered and encoded on a prompt thread, within `client`'s
        share."""
        if self.chat is None:
            raise APIError(500, "chat completions need a tokenizer and this server has none")
        self.chat.check(messages, tools)
        return await self.prompt_workers.run(client, self.chat.ids, messages, tools)

    def chat_default_max_tokens(self, prompt_len: int) -> int:
        limit = min(self.server.max_model_len, self.server.n_slots)
        return max(1, min(self.default_max_tokens, limit - prompt_len))

    # -- logprobs and echo ----------------------------------------------------------------------

    @property
    def token_texts(self) -> TokenTexts:
        """Single-token texts for logprobs (made on first use: it copies the tokenizer)."""
        if self._token_texts is None:
            self._token_texts = TokenTexts(self.server.tokenizer)
        return self._token_texts

    def echo_text(self, prompt: str | list[int], out: Any) -> str:
        """The prompt as completions' echo shows it: the client's text, or its token ids decoded."""
        return prompt if isinstance(prompt, str) else self.token_texts.text(out.prompt_token_ids)

    def completion_choice_logprobs(self, body: protocol.CompletionRequest, out: Any, *, start: int = 0,
                                   prompt: bool = False, text_offset: int = 0) -> dict | None:
        """Completions' logprobs of the generated tokens from index `start` (and before them the
        prompt's, when `prompt`), or None when the request did not ask for logprobs."""
        if body.logprobs is None:
            return None
        entries: list = list(out.logprobs[start:]) if out.logprobs is not None else []
        ids: list[int] = list(out.token_ids[start:])
        if prompt and out.prompt_logprobs is not None:
            entries = list(out.prompt_logprobs) + entries
            ids = list(out.prompt_token_ids) + ids
        return completion_logprobs(entries, ids, self.token_texts, text_offset)

    def chat_choice_logprobs(self, body: protocol.ChatCompletionRequest, out: Any, start: int = 0) -> dict | None:
        """Chat's logprobs of the generated tokens from index `start`, or None when not asked."""
        if not body.logprobs or out.logprobs is None:
            return None
        return chat_logprobs(out.logprobs[start:], self.token_texts)

    @staticmethod
    def chosen(adm: Admission, body: protocol._SamplingFields) -> list[tuple[int, Any]]:
        """(prompt index, output) of the outputs that become choices, in choice order: each
        prompt's n, or with best_of > n its n of highest cumulative logprob (ties: the lower
        sequence index first)."""
        n, per_prompt = body.n or 1, adm.per_prompt
        choices = []
        for p, start in enumerate(range(0, len(adm.outputs), per_prompt)):
            outs = adm.outputs[start:start + per_prompt]
            if len(outs) > n:
                ranked = sorted(range(len(outs)), key=lambda i: (-sum(e.logprob for e in outs[i].logprobs), i))
                outs = [outs[i] for i in sorted(ranked[:n])]
            choices += [(p, out) for out in outs]
        return choices

    @staticmethod
    def usage_of(outputs: list[Any], per_prompt: int) -> dict:
        """Usage over every sequence generated (best_of's extra ones included, as OpenAI bills).
        Each prompt counts once, with its first sequence's cached tokens (its siblings share that
        prefill)."""
        firsts = outputs[::per_prompt]
        return protocol.usage(sum(len(o.prompt_token_ids) for o in firsts), sum(len(o.token_ids) for o in outputs),
                              sum(o.num_cached_tokens for o in firsts))

    def completion_json(self, adm: Admission, created: int, body: protocol.CompletionRequest) -> dict:
        """The non-streaming completions response of a finished request: one choice per sequence."""
        choices = []
        for index, (p, out) in enumerate(self.chosen(adm, body)):
            prefix = self.echo_text(body.prompts[p], out) if body.echo else ""
            choice = protocol.completion_body(adm.rid, created, self.model_name, prefix + out.text,
                                              out.finish_reason, None, chunk=True)["choices"][0]
            choice.update(index=index, logprobs=self.completion_choice_logprobs(
                body, out, prompt=bool(body.echo), text_offset=0))
            choices.append(choice)
        result = protocol.completion_body(adm.rid, created, self.model_name, "", None,
                                          self.usage_of(adm.outputs, adm.per_prompt), chunk=False)
        result["choices"] = choices
        return result

    def chat_json(self, adm: Admission, created: int, body: protocol.ChatCompletionRequest) -> dict:
        """The non-streaming chat response of a finished request: one choice per sequence."""
        choices = []
        for index, (_, out) in enumerate(self.chosen(adm, body)):
            choice = protocol.chat_body(adm.rid, created, self.model_name, out.text, out.finish_reason,
                                        None)["choices"][0]
            choice.update(index=index, logprobs=self.chat_choice_logprobs(body, out))
            choices.append(choice)
        result = protocol.chat_body(adm.rid, created, self.model_name, "", None,
                                    self.usage_of(adm.outputs, adm.per_prompt))
        result["choices"] = choices
        return result

    # -- engine ---------------------------------------------------------------------------------

    async def submit(self, adm: Admission, prompts: Sequence[str | list[int]], body: protocol._SamplingFields,
                     max_tokens: int, *, client: str) -> None:
        """Submit the request's sequences to the engine: body.num_sequences of each prompt. Text
        prompts are encoded first, on a prompt thread within `client`'s share. A batch is checked
        whole before any of it is queued: a prompt the engine refuses raises its
        InvalidRequestError (app.py reports it in the endpoint's field names), for a batch with
        the prompt's place in front ("prompt.2: ...")."""
        try:
            guided = await self.guided_grammar(body, client)
            params = SamplingParams(**body.sampling_kwargs(max_tokens), **body.logits_kwargs(), guided=guided)
            count = body.num_sequences
            if count > 1 and body.ranks_sequences:
                # best_of > n ranks the sequences by their cumulative logprob.
                params = dataclasses.replace(params, logprobs=params.logprobs or 0)
            encoder = self.server.prompt_encoder
            ids = []
            for p, prompt in enumerate(prompts):
                with _naming_prompt(p if len(prompts) > 1 else None):
                    if isinstance(prompt, str) and encoder is not None:
                        prompt = await self.prompt_workers.run(client, text_prompt_ids, encoder, prompt)
                    # Checked off the event loop: a batch's ids are up to the body limit's worth.
                    ids.append(await asyncio.to_thread(self.server.check, prompt, params)
                               if len(prompts) > 1 else prompt)
            adm.per_prompt = count
            adm.seq_rids = []   # grows as the engine takes them: only those are aborted on failure
            # Prompts of a batch that share a context start from one prefill of it: through the
            # prefix cache once it is computed (a fork would need the first prompt still running).
            context_of = shared_contexts(ids) if self.server.config.prefix_caching else [None] * len(ids)
            # The prompts that start a shared context go first: the others copy its KV from them.
            for p in sorted(range(len(ids)), key=lambda p: context_of[p] is not None):
                first = adm.seq_rid(p)
                shared = {} if context_of[p] is None else {"share_prefill_with": adm.seq_rid(context_of[p])}
                with _naming_prompt(p if len(ids) > 1 else None):
                    await asyncio.to_thread(self.server.submit, ids[p], params, request_id=first, client=client,
                                            **shared)
                adm.seq_rids.append(first)
                adm.submitted = True
                for i in range(1, count):
                    # `prompt` is token ids by now: the siblings reuse the first sequence's and its prefill.
                    rid = adm.seq_rid(p, i)
                    await asyncio.to_thread(self.server.submit, ids[p], params.for_sequence(i), request_id=rid,
                                            client=client, share_prefill_with=first)
                    adm.seq_rids.append(rid)
            adm.seq_rids.sort(key=adm.seq_index)
        except EngineDeadError as exc:
            raise APIError(503, str(exc), code="engine_dead") from exc
        except ServerClosedError as exc:
            raise APIError(503, "The server is shutting down", code="server_closed",
                           headers={"Retry-After": "5"}) from exc
        adm.submitted = True
        if self.cutting:  # admitted before the drain began, submitted after its grace period
            self.cut(adm)

    async def guided_grammar(self, body: Any, client: str) -> CompiledGrammar | None:
        """The compiled output grammar of the request (None: unconstrained), compiled on a grammar
        thread within `client`'s share; InvalidRequestError naming the field for a constraint
        that is malformed, over its bounds or too slow to compile."""
        spec = body.guided_spec()
        if spec is None:
            return None
        if self.grammars is None:
            raise InvalidRequestError(f"{spec.field}: guided decoding needs a tokenizer and this server has none",
                                      param=spec.field)
        return await self.grammar_workers.run(client, self.grammars.compile, spec)

    async def collect(self, adm: Admission, request: Request) -> Any:
        """The final output, or None when the client disconnected first (the caller's
        admission.close() then aborts the request)."""
        streams = [self.server.stream_async(rid) for rid in adm.seq_rids]

        async def last(stream) -> Any:
            final = None
            async for out in stream:
                final = out
            return final

        result_task = asyncio.ensure_future(asyncio.gather(*(last(st) for st in streams)))
        watch_task = asyncio.ensure_future(_wait_disconnect(request))
        try:
            done, _ = await asyncio.wait({result_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
            if result_task not in done:
                self.logs.aborted.log("request %s: client disconnected before the result", adm.rid)
                return None
            finals = result_task.result()
        finally:
            watch_task.cancel()
            if not result_task.done():
                result_task.cancel()
        adm.outputs = list(finals)
        if any(out is None or not out.finished for out in finals):
            return None if finals[0] is None else finals[0]
        adm.finished = True
        self.observe_finished(adm, adm.outputs)
        return self.worst(adm.outputs)


# A prompt of a batch starts from the KV of an earlier prompt's context when they share at least
# this many leading tokens and at least half of its own: it waits for that prompt's prefill, so
# a short shared start is not worth the wait.
MIN_SHARED_CONTEXT = 16


def shared_contexts(prompts: list[list[int]]) -> list[int | None]:
    """For each prompt of a batch, the prompt whose context it copies (the first, in sorted
    order, of the run of prompts that share a long start with it), or None: it prefills alone.
    Sorted, prompts that share a start are neighbours, and a prompt shares with the run's first
    the least of the neighbours' shared starts between them."""
    context_of: list[int | None] = [None] * len(prompts)
    order = sorted(range(len(prompts)), key=lambda p: prompts[p])
    head, run = (order[0] if order else None), None
    for prev, p in zip(order, order[1:]):
        common = common_prefix(prompts[prev], prompts[p], 0, len(prompts[p]))
        run = common if run is None else min(run, common)
        if run >= max(MIN_SHARED_CONTEXT, len(prompts[p]) / 2):
            context_of[p] = head
        else:
            head, run = p, None
    return context_of


@contextlib.contextmanager
def _naming_prompt(index: int | None) -> Iterator[None]:
    """Puts the prompt's place in a batch in front of a refusal of that prompt: param "prompt"
    becomes "prompt.<index>", and the message starts with it."""
    try:
        yield
    except InvalidRequestError as exc:
        if index is None:
            raise
        where = f"prompt.{index}"
        raise InvalidRequestError(f"{where}: {exc}", param=where if exc.param == "prompt" else exc.param) from exc


async def _wait_disconnect(request: Request) -> None:
    # After the body is read, the only message left for this request is http.disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
