"""The gateway's completion path, without FastAPI: forwarding OpenAI calls to engines and recording every
completion to Kafka before the caller gets its answer.

A caller's answer always waits for Kafka: a completion's body (or a stream's final `data: [DONE]`) is sent only
after its Completion events (and the ToolSpans its request revealed) were acknowledged (acks=all). If Kafka does
not acknowledge, the caller gets 503 with Retry-After (in a stream: an error event instead of [DONE]) and the
session's state (turn counter, pending tool calls) is rolled back.

One turn per turn: a session's completions are written one request at a time, and each request's turn number is
taken from what is recorded, so its turn numbers stay 0, 1, 2... in the order they were recorded, each once:
- concurrent requests of the session, failed ones too, and on several workers of one host (which number a
  session's turns under a lock of the workers' ledger, forge_stream.gateway.ledger);
- a write Kafka did not acknowledge may still have landed (a delivery timed out while the broker had it): the 503
  says so, and the session reads its log before its next turn (`Session.unsure`), so that turn is numbered past it;
- a call sent with an `Idempotency-Key` header (chat and completions) is recorded under a request id derived from
  the session and the key, with the digest of its endpoint and body (`request_digest`): a retry of a call that was
  recorded (its answer lost, or its 503 ambiguous) is recognised, read back from Kafka and answered as it was
  recorded (message, tool calls, finish reason; no log-probs or token ids), without running the engine again; the
  key with another endpoint or body is refused (422). Tries of one key run one at a time: here (a try waits for the
  one in flight) and on the workers of one host (the ledger's lock of the call, `SessionRestorer.claim`), so
  calls sent at once with one key run the engine once and all get its answer.
A chat prompt that extends an earlier completion of the session is recorded by reference to it
(forge_stream.events.prompts; `GatewaySettings.prompt_refs`), so a session's bytes grow linearly with its turns,
not with their square.

Limits (GatewaySettings) are checked before a request reaches an engine or Kafka: a body's size and JSON depth
(forge_stream.httpbody), identifiers and OpenAI requests (forge_stream.gateway.checks), and the least size its
Completion events will have (`_check_event_size`); each answers 4xx. An event that still turns out larger than its
topic takes (the engine's token ids added) is 413 too, after the engine ran, and nothing is recorded.

A session whose agents send tool results as user messages names a rule that reads its tool spans from the text
(forge_stream.gateway.textspans: metadata `span_rule`, or a built-in rule's name as `X-Forge-Agent`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from typing import Protocol

import aiohttp
import orjson
from confluent_kafka import KafkaError, KafkaException

from forge_stream.events import deterministic_id, new_event_id, now_ms
from forge_stream.events.prompts import Lane, by_reference, message_digest, shared_prefix
from forge_stream.gateway.admission import Lease
from forge_stream.gateway.checks import check_request
from forge_stream.gateway.engines import Engine, EnginePool
from forge_stream.gateway.protocol import GatewayError, engine_error, engine_stream_error, invalid
from forge_stream.gateway.recording import (
    ChoiceRecord, Kind, RequestContext, StreamAccumulator, chat_choices, chat_messages_json, client_json,
    completion_choices, completion_record, dumps, engine_json, request_digest, sampling_setting,
)
from forge_stream.gateway.replay import recorded_answer
from forge_stream.gateway.restore import SessionRestorer
from forge_stream.gateway.sessions import Session
from forge_stream.gateway.settings import GatewaySettings
from forge_stream.gateway.spans import PendingCall, answered_calls, inferred_span, pending_calls
from forge_stream.gateway.textspans import TextTurn, agent_rule, text_spans
from forge_stream.topics import TOPICS, Topic

log = logging.getLogger(__name__)
_JSON = {"content-type": "application/json"}
PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}


class EventSink(Protocol):
    """Where events go; `send` resolves once the event is durable (EventProducer is the real one)."""

    def send(self, topic: Topic, key: str, record: dict, schema: str | None = None) -> Awaitable[int]: ...


def upstream_body(kind: Kind, body: dict) -> bytes:
    """The request as forwarded: always asking for token ids and the sampled tokens' logprobs."""
    forwarded = dict(body)
    forwarded["return_token_ids"] = True
    if kind == "chat":
        forwarded["logprobs"] = True
    elif forwarded.get("logprobs") is None:
        forwarded["logprobs"] = 0
    return orjson.dumps(forwarded)


def hidden_fields(kind: Kind, body: dict) -> tuple[bool, bool]:
    """(logprobs, token ids): whether the gateway asked the engine for them only to record them, since the
    client did not ask; those are taken out of what the client gets.

    >>> hidden_fields("chat", {"logprobs": True}), hidden_fields("completion", {"logprobs": 0})
    ((False, True), (False, True))
    """
    logprobs = not body.get("logprobs") if kind == "chat" else body.get("logprobs") is None
    return logprobs, not body.get("return_token_ids")


def for_client(data: dict, hide_logprobs: bool, hide_ids: bool) -> dict:
    """An engine response (or stream chunk) without the logprobs and token ids the client did not ask for.

    >>> for_client({"prompt_token_ids": [1], "choices": [{"text": "a", "token_ids": [2], "logprobs": {}}]},
    ...            True, True)
    {'choices': [{'text': 'a', 'logprobs': None}]}
    """
    if hide_ids:
        data.pop("prompt_token_ids", None)
    for choice in data.get("choices") or ():
        if hide_logprobs and choice.get("logprobs") is not None:
            choice["logprobs"] = None
        if hide_ids:
            choice.pop("token_ids", None)
            choice.pop("prompt_token_ids", None)
    return data


def sse_data(event: bytes) -> bytes | None:
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            return line[5:].strip()
    return None


def reused_key(key: str) -> GatewayError:
    return GatewayError(422, f"Idempotency-Key {key!r} was sent with another request of this session (another "
                             "endpoint or body): a retry must repeat its request as it was; a new request needs a new "
                             "key.", "invalid_request_error", "Idempotency-Key", code="idempotency_key_reused")


class NotAcknowledged(GatewayError):
    """503: events were sent and Kafka did not acknowledge them, so they may still have been written."""


class CompletionPath:
    """The engine and completion half of GatewayService (forge_stream.gateway.serving), which sets `settings`,
    `sink`, `http`, `pool` and `restorer`."""

    settings: GatewaySettings
    sink: EventSink
    http: aiohttp.ClientSession
    pool: EnginePool
    restorer: SessionRestorer
    calls_answered = 0  # chat and completions calls this process answered (run, or answered as recorded)

    def unavailable(self, message: str) -> GatewayError:
        return GatewayError(503, message, "service_unavailable", retry_after=self.settings.retry_after_s)

    def engine_failed(self, engine: Engine, exc: BaseException) -> GatewayError:
        """503 for an engine that broke off: the caller learns the kind of failure, the log where and why."""
        log.warning("engine %s failed: %s: %s", engine.url, type(exc).__name__, exc)
        return self.unavailable(f"The engine failed ({type(exc).__name__}); retry shortly.")

    async def publish(self, items: list[tuple[Topic, str, dict, str | None]]) -> list[int]:
        """Send every event and wait until Kafka acknowledged all of them (their offsets); 503 if any was not."""
        futures = []
        error: BaseException | None = None
        for topic, key, record, schema in items:
            try:
                futures.append(self.sink.send(topic, key, record, schema))
            except BufferError as exc:  # librdkafka's local queue is full: Kafka is not keeping up
                error = exc
                break
            except KafkaException as exc:  # refused before sending: too large, or the producer is broken
                error = exc
                break
        results: list = []
        try:
            async with asyncio.timeout(self.settings.ack_timeout_ms / 1000 + 5):  # librdkafka's timeout comes first
                for future in futures:  # one after another: no gather or wait_for task on the hot path
                    try:
                        results.append(await future)
                    except Exception as exc:  # noqa: BLE001 - a DeliveryError, told to the caller below
                        results.append(exc)
        except TimeoutError as exc:
            results.append(exc)
        if not futures and isinstance(error, KafkaException) and error.args[0].code() == KafkaError.MSG_SIZE_TOO_LARGE:
            raise GatewayError(413, f"This request's {topic.name} event is larger than Kafka accepts; send less "
                                    f"(shorter metadata, tool arguments or prompts).", "invalid_request_error")
        error = error or next((r for r in results if isinstance(r, BaseException)), None)
        if error is not None:
            log.warning("Kafka did not acknowledge %s events: %s", topic.name, error)
            if not futures:
                raise self.unavailable("Kafka did not take the events, so nothing was recorded; retry shortly.")
            raise NotAcknowledged(503, "Kafka did not acknowledge the events in time: they may or may not have been "
                                       "recorded. Retry the call; with the same Idempotency-Key header a call that "
                                       "was recorded is answered as it was recorded.", "service_unavailable",
                                  retry_after=self.settings.retry_after_s)
        return results

    # ----- engines ---------------------------------------------------------------------------------------

    async def _send(self, group_id: str, method: str, path: str,
                    payload: bytes | None) -> tuple[aiohttp.ClientResponse, Engine]:
        """Send to the group's engine, or the next if it gave no answer (refused or dropped the connection, or said
        503: starting again; nothing is recorded before an answer is whole); the engine's in-flight count is raised
        and the caller lowers it (and releases the response) when done. The last engine's 503 is the answer."""
        failures, engines = [], self.pool.order(group_id)
        for i, engine in enumerate(engines):
            engine.in_flight += 1
            try:
                response = await self.http.request(method, engine.url + path, data=payload,
                                                   headers=_JSON if payload is not None else None)
            except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError) as exc:
                engine.in_flight -= 1
                failures.append(f"{engine.url}: {type(exc).__name__} {exc}")
                continue
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                engine.in_flight -= 1
                raise self.engine_failed(engine, exc) from exc
            if response.status != 503 or i == len(engines) - 1:
                return response, engine
            response.release()
            engine.in_flight -= 1
            failures.append(f"{engine.url}: HTTP 503")
        log.warning("no engine is reachable: %s", "; ".join(failures))
        raise self.unavailable("No engine is reachable; retry shortly.")

    async def _read(self, response: aiohttp.ClientResponse, engine: Engine) -> bytes:
        """The whole body of a response from `engine`; 503 if the engine breaks off."""
        try:
            return await response.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise self.engine_failed(engine, exc) from exc
        finally:
            response.release()
            engine.in_flight -= 1

    async def models(self) -> bytes:
        response, engine = await self._send("", "GET", "/v1/models", None)
        content = await self._read(response, engine)
        if response.status != 200:
            raise engine_error(response.status, content)
        return content

    # ----- completions -----------------------------------------------------------------------------------

    async def complete(self, session: Session, kind: Kind, body, agent: str, lease: Lease,
                       request_id: str | None = None,
                       idempotency_key: str | None = None) -> bytes | AsyncIterator[bytes]:
        """Forward one OpenAI request of `session` (recorded under `request_id`, default a new id, or one derived
        from `idempotency_key`: a retry of a recorded call is answered as recorded) in the admission slot `lease`
        (taken before its body was read: the router's `_admitted`), which it takes over; returns the response body,
        or an SSE byte stream."""
        if idempotency_key is not None:
            request_id = deterministic_id("request", session.id, idempotency_key)
        request_id = request_id or new_event_id()
        entered, digest = False, None
        try:
            session.require_open()
            n = check_request(kind, body, self.settings)
            if len(agent) > self.settings.max_id_length:
                raise invalid(f"X-Forge-Agent is longer than {self.settings.max_id_length} characters.",
                              "X-Forge-Agent")
            if idempotency_key is None:
                session.enter(request_id)
                entered = True
            else:
                digest = request_digest(kind, body)
                await self._enter_once(session, request_id)
                entered = True
                if answer := await self._recorded(session, kind, body, request_id, digest, idempotency_key):
                    self._leave(session, request_id)
                    lease.release()
                    self.calls_answered += 1
                    return answer
            result = await self._forward(session, kind, body, agent, lease.asked_ms, n, lease, request_id, digest)
        except BaseException:
            if entered:
                self._leave(session, request_id)
            lease.release()
            raise
        if isinstance(result, bytes):
            self._leave(session, request_id)
            lease.release()
        self.calls_answered += 1
        return result

    async def _enter_once(self, session: Session, request_id: str) -> None:
        """Enter the call `request_id` of an Idempotency-Key once no other try of it is in flight: one here is
        waited for, then one on another worker of this host. (A try with another endpoint or body waits too: which
        request the key is bound to is what the first try that is recorded asked.)"""
        while (first := session.calls.get(request_id)) is not None:
            await first.wait()
        session.require_open()
        session.enter(request_id)  # no await since the check: the other tries here wait for this one
        try:
            await self.restorer.claim(request_id)
        except BaseException:
            session.leave(request_id)
            raise

    def _leave(self, session: Session, request_id: str) -> None:
        """The call `request_id` ended here: its next try may run, here or on another worker."""
        session.leave(request_id)
        self.restorer.release(request_id)

    async def _recorded(self, session: Session, kind: Kind, body: dict, request_id: str, digest: str,
                        key: str) -> bytes | AsyncIterator[bytes] | None:
        """The answer of the call `request_id` as it was recorded, if it was; None when it was not. 422 when it
        was recorded for another endpoint or body."""
        session.require_open()
        async with session.recording, self.restorer.numbering(session):  # up to date with the other workers' turns
            pass
        if request_id not in session.requests:
            return None
        records = await self.restorer.answered(session, request_id)
        if not records:
            return None
        if records[0]["request_digest"] not in (None, digest):  # (None: recorded before requests had digests)
            raise reused_key(key)
        log.info("session %s: call %s was recorded already (turn %d): answered as recorded", session.id,
                 request_id, records[0]["turn"])
        return recorded_answer(kind, request_id, records, bool(body.get("stream")))

    async def _forward(self, session: Session, kind: Kind, body: dict, agent: str, received: int, n: int,
                       lease: Lease, request_id: str, digest: str | None) -> bytes | AsyncIterator[bytes]:
        """`complete` past admission (`digest`: its request's, with an Idempotency-Key); a stream takes over `lease`
        and releases it when it ends."""
        session.require_open()  # again: it may have been finished while this call waited for a slot
        answered = answered_calls(body["messages"], session.pending) if kind == "chat" else []
        session.take_answered([call for call, _ in answered])
        spans = [inferred_span(session.keys, call, content, received) for call, content in answered]
        taken = [call for call, _ in answered]
        rule = session.span_rule or agent_rule(agent)
        if rule is not None and kind == "chat":  # a text-protocol agent: its tool results come as user messages
            more, answered_text = text_spans(rule, session.keys, body["messages"], agent, session.text_turns.get(agent),
                                             session.pending, session.span_ids | {s["span_id"] for s in spans},
                                             received)
            session.take_answered(answered_text)
            spans, taken = spans + more, taken + answered_text
        keys = session.keys
        parts = tuple(orjson.dumps(m) for m in body["messages"]) if kind == "chat" else ()
        ctx = RequestContext(
            session_id=keys.session_id, group_id=keys.group_id, task_id=keys.task_id, request_id=request_id,
            agent=agent, received_ms=received, kind=kind,
            messages_json=chat_messages_json(parts) if kind == "chat" else dumps(body["prompt"]),
            tools_json=dumps(body["tools"]) if kind == "chat" and body.get("tools") else None,
            temperature=sampling_setting(body, "temperature"), top_p=sampling_setting(body, "top_p"),
            logprobs_mode=self.settings.engine_logprobs_mode, message_parts=parts,
            message_digests=tuple(map(message_digest, parts)) if self.settings.prompt_refs else (),
            request_digest=digest)
        try:
            self._check_event_size(session, ctx, body)
        except GatewayError:
            session.restore(taken)
            raise
        stream = bool(body.get("stream"))
        hide = hidden_fields(kind, body)
        try:
            response, engine = await self._send(keys.group_id, "POST", PATHS[kind], upstream_body(kind, body))
            if not stream or response.status != 200:
                content = await self._read(response, engine)
                if response.status != 200:
                    raise engine_error(response.status, content)
        except BaseException:
            session.restore(taken)
            raise
        if stream:
            return self._relay(session, ctx, response, engine, n, spans, taken, hide, lease)
        done = now_ms()
        data = engine_json(content)
        choices = chat_choices(data) if kind == "chat" else completion_choices(data, n)
        try:
            await self._record(session, ctx, choices, engine, data.get("model") or body.get("model") or "",
                               data.get("policy_version"), None, done, spans,  # (usage sums a batch's prompts)
                               data.get("prompt_cache") if all(c.prompt_index == 0 for c in choices) else None)
        except BaseException:
            session.restore(taken)
            raise
        return client_json(for_client(data, *hide)) if any(hide) else content

    def _check_event_size(self, session: Session, ctx: RequestContext, body: dict) -> None:
        """413 before the engine runs when the Completion events of this request cannot fit in Kafka whatever
        the engine answers: the messages they will record (those after the longest run of messages that one of the
        session's lanes holds, when prompts go by reference), or the prompt of a completions request, plus the
        tools, already exceed `max_event_bytes`."""
        limit = self.settings.max_event_bytes or TOPICS.completions.max_message_bytes
        if ctx.kind == "chat":
            parts = ctx.message_parts
            kept = 0
            if self.settings.prompt_refs and session.lanes:
                kept = max(shared_prefix(lane.messages, ctx.message_digests) for lane in session.lanes.values())
            floor = sum(len(p) + 1 for p in parts[kept:])
        else:
            prompts = body["prompt"]
            many = isinstance(prompts, list) and not isinstance(prompts[0], int)
            floor = max(len(dumps(p)) for p in prompts) if many else len(ctx.messages_json)
        floor += len(ctx.tools_json or "")
        if floor > limit:
            raise GatewayError(413, f"This request's prompt would be recorded as a Completion event of at least "
                                    f"{floor} bytes, and {TOPICS.completions.name} takes at most {limit}: send a "
                                    f"shorter prompt (or fewer tools).", "invalid_request_error",
                               "messages" if ctx.kind == "chat" else "prompt")

    async def _record(self, session: Session, ctx: RequestContext, choices: list[ChoiceRecord], engine: Engine,
                      model: str, policy_version: int | None, first_token_ms: int | None, done: int,
                      spans: list[dict], prompt_cache: dict | None = None) -> None:
        version = self.settings.default_policy_version if policy_version is None else policy_version
        group = ctx.group_id
        # one turn at a time, numbered from what is recorded: a failed write gives its turn number back
        async with session.recording, self.restorer.numbering(session):
            turn = session.turns
            by_ref = self.settings.prompt_refs and ctx.kind == "chat"
            records = [completion_record(ctx, c, turn=turn, model=model, engine_id=engine.url,
                                         policy_version=version, first_token_ms=first_token_ms, done_ms=done,
                                         prompt_ids=not by_ref, prompt_cache=prompt_cache)
                       for c in choices]
            sent = [by_reference(r, ctx.message_parts, session.lanes.values(), ctx.message_digests, c.prompt)
                    if by_ref and c.prompt is not None else r
                    for c, r in zip(choices, records)]
            log = self.restorer.log  # shared sessions: other replicas' records are told from this one's by request id
            if log is not None:
                log.recording(ctx.request_id)
            try:
                offsets = await self.publish([(TOPICS.completions, group, r, None) for r in sent]
                                             + [(TOPICS.tool_spans, group, s, None) for s in spans])
            except BaseException as exc:
                if isinstance(exc, NotAcknowledged):  # it may have landed: the next turn reads the log first
                    session.unsure = True
                elif log is not None:
                    log.not_recorded(ctx.request_id)
                raise
            self.restorer.wrote(session, {TOPICS.completions.name: offsets[:len(sent)],
                                          TOPICS.tool_spans.name: offsets[len(sent):]})
            session.turns = turn + 1
            session.requests.add(ctx.request_id)
            if by_ref:
                for choice, record in zip(choices, records):
                    if choice.prompt:  # the choices of a chat answer share one PromptIds: parsed or hashed once
                        session.lanes[(ctx.agent, choice.index)] = Lane(
                            record["completion_id"], choice.prompt, choice.token_ids or [], ctx.message_digests)
        session.completions += len(records)
        session.span_ids.update(s["span_id"] for s in spans)
        for choice, record in zip(choices, records):
            session.add_pending(pending_calls(choice.tool_calls, issued_ms=done,
                                              completion_id=record["completion_id"], agent=ctx.agent))
        if records and (session.span_rule or agent_rule(ctx.agent)):
            session.text_turns[ctx.agent] = TextTurn(done, tuple((r["completion_id"], c.text)
                                                                 for c, r in zip(choices, records)))

    async def _relay(self, session: Session, ctx: RequestContext, response: aiohttp.ClientResponse,
                     engine: Engine, n: int, spans: list[dict], taken: list[PendingCall],
                     hide: tuple[bool, bool], lease: Lease) -> AsyncIterator[bytes]:
        """Forward the engine's SSE events as they come (without the fields in `hide`); record, then send
        [DONE] (or an error event); the admission `lease` is released at the end."""
        try:
            async with aclosing(self._relay_events(session, ctx, response, engine, n, spans, taken, hide)) as events:
                async for event in events:
                    yield event
        finally:
            self._leave(session, ctx.request_id)
            lease.release()

    async def _relay_events(self, session: Session, ctx: RequestContext, response: aiohttp.ClientResponse,
                            engine: Engine, n: int, spans: list[dict], taken: list[PendingCall],
                            hide: tuple[bool, bool]) -> AsyncIterator[bytes]:
        acc = StreamAccumulator(ctx.kind, n)
        buffer, done, engine_error = b"", False, False
        try:
            async for raw in response.content.iter_any():
                buffer += raw
                while not done and (cut := buffer.find(b"\n\n")) >= 0:
                    event, buffer = buffer[:cut + 2], buffer[cut + 2:]
                    data = sse_data(event)
                    if data == b"[DONE]":
                        done = True
                        break
                    if data:
                        chunk = engine_json(data)
                        if "error" in chunk:
                            engine_error = True
                            event = engine_stream_error(chunk)
                        else:
                            acc.feed(chunk, now_ms())
                            if any(hide):
                                event = b"data: " + client_json(for_client(chunk, *hide)) + b"\n\n"
                    yield event
                if done:
                    break
        except (aiohttp.ClientError, asyncio.TimeoutError):
            done = False
        finally:
            response.release()
            engine.in_flight -= 1
            if not done or engine_error:
                session.restore(taken)
        if engine_error:
            yield b"data: [DONE]\n\n"
            return
        if not done:
            yield b"data: " + self.unavailable("The engine ended the stream early; nothing was recorded.").body()
            yield b"\n\n"
            return
        try:
            await self._record(session, ctx, acc.results(), engine, acc.model or "", acc.policy_version,
                               acc.first_token_ms, now_ms(), spans)
        except GatewayError as exc:
            session.restore(taken)
            yield b"data: " + exc.body() + b"\n\n"
            return
        yield b"data: [DONE]\n\n"
