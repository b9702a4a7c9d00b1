"""sf-regen's turns: the state of one conversation as its assistant turns are regenerated on the
regenerated history, what each generated turn becomes (kept, trimmed at a loop, the recorded turn
kept where the tool calls disagree, or the conversation dropped), and what a shard counts."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field

from specfoundry.conversations.records import Conversation, Message, with_json_arguments
from specfoundry.generate.backends.interface import Generation, Request, derive_seed
from specfoundry.generate.reasoning import channel_template, opens_reasoning, split_answer
from specfoundry.generate.repetition import loop_cut
from specfoundry.generate.tools import same_calls, with_recorded_ids


@dataclass
class ShardCounts:
    conversations_in: int = 0
    conversations_written: int = 0
    dropped_empty: int = 0
    dropped_truncated: int = 0
    dropped_failed: int = 0
    dropped_tool_mismatch: int = 0
    turns_ok: int = 0
    turns_empty: int = 0
    turns_truncated: int = 0
    turns_loop_trimmed: int = 0
    loop_tokens_removed: int = 0
    turns_failed: int = 0
    turns_reasoning_unclosed: int = 0  # a reasoning never closed (cut, or the turn ended in it): dropped
    # a server's reasoning_content kept as a <think> block with no local tokenizer to see the template
    # (right for Qwen3's and DeepSeek-R1's, not for a channel template's thinking field: --target)
    turns_reasoning_joined_unseen: int = 0
    generated_tokens: int = 0
    synthetic_prompts_empty: int = 0
    # every recorded tool exchange of the conversations in ends as one of these three
    tool_exchanges_kept: int = 0  # the target made the recorded calls: its turn is kept
    tool_exchanges_replaced: int = 0  # it did not: the recorded turn is kept in its place
    tool_exchanges_dropped: int = 0  # in a conversation that was not written
    tool_calls_unrecorded: int = 0  # the target called a tool where the record answers: the record's answer kept


@dataclass
class ConversationState:
    conv: Conversation
    index: int  # position in its shard; with the turn, it picks the request's seed
    built: list[dict] = field(default_factory=list)
    cursor: int = 0  # next original message to copy
    turn: int = 0  # assistant turns answered
    finish_reasons: list[str] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    flags: list[str] = field(default_factory=list)
    status: str = "ok"  # ok | empty | truncated | failed | tool_mismatch
    tool_exchanges: Counter = field(default_factory=Counter)  # kept / replaced
    mode: dict = field(default_factory=lambda: {"chat_template_kwargs": {}, "reasoning": "keep"})

    def next_request(self, shard: int, seed: int, tag: int) -> Request | None:
        """The request (tagged `tag`) for the next assistant turn, the original turns before it
        copied into the history; None when the conversation is finished or dropped."""
        if self.status != "ok" or self.turn == self.conv.turns_to_answer:
            return None
        msgs = self.conv.messages
        while self.cursor < len(msgs) and msgs[self.cursor].role != "assistant":  # (the open last turn: all of them)
            self.built.append(msgs[self.cursor].to_dict())
            self.cursor += 1
        return Request(tag=tag, seed=derive_seed(seed, shard, self.index, self.turn),
                       messages=tuple(self.built), tools=self.conv.tools,
                       template_kwargs=dict(self.mode["chat_template_kwargs"]) or None)

    def row(self) -> dict:
        return {
            "id": self.conv.id,
            "messages": [with_json_arguments(m) for m in self.built],
            "tools": json.dumps(list(self.conv.tools)) if self.conv.tools else None,
            "source": self.conv.location,
            "finish_reasons": self.finish_reasons,
            "gen_token_ids": self.token_ids,
            "flags": self.flags,
            "mode": json.dumps(self.mode, sort_keys=True),
        }


def shard_rows(states: list[ConversationState], counts: ShardCounts) -> list[dict]:
    """The rows of a finished shard's conversations, its counts completed."""
    counts.conversations_in += len(states)
    rows = []
    for s in states:
        if s.status == "ok":
            rows.append(s.row())
            counts.tool_exchanges_kept += s.tool_exchanges["kept"]
            counts.tool_exchanges_replaced += s.tool_exchanges["replaced"]
        else:
            setattr(counts, f"dropped_{s.status}", getattr(counts, f"dropped_{s.status}") + 1)
            counts.tool_exchanges_dropped += s.conv.num_tool_exchanges
    counts.conversations_written += len(rows)
    return rows


def record_turn(cfg, tokenizer, s: ConversationState, g: Generation, counts: ShardCounts) -> None:
    """Put the generation `g` for s's next assistant turn into its history (or the recorded
    turn where the tool calls disagree), and count what it was. `cfg`: the run's RegenConfig (its
    --on-empty, --on-truncated, --on-tool-mismatch); `tokenizer`: the backend's, or None."""
    # the recorded assistant turn this one replaces; none for the open last turn of a prompt (its
    # answer, tool calls or not, is the target's own)
    recorded = s.conv.messages[s.cursor] if s.cursor < len(s.conv.messages) else None
    s.cursor += 1  # past the original assistant turn we replace
    turn, s.turn = s.turn, s.turn + 1
    counts.generated_tokens += g.num_tokens
    if recorded is not None and g.finish_reason != "error" and (recorded.tool_calls or g.tool_calls):
        if recorded.tool_calls and same_calls(g.tool_calls, recorded.tool_calls):
            s.tool_exchanges["kept"] += 1
            g = Generation(g.text, g.finish_reason, g.token_ids, g.num_tokens,
                           tool_calls=with_recorded_ids(g.tool_calls, recorded.tool_calls))
        else:
            keep_recorded(cfg, s, recorded, turn, counts)
            return
    if g.finish_reason == "length" and cfg.on_truncated == "trim" and not g.tool_calls:
        g = trim_loop(tokenizer, g, counts)
    answer = split_answer(g.text, s.mode["reasoning"], opened=prompt_opens_reasoning(tokenizer, s),
                          reasoning_content=g.reasoning, channels=channel_template(tokenizer))
    counts.turns_reasoning_joined_unseen += g.reasoning is not None and tokenizer is None and s.mode["reasoning"] == "keep"
    if answer.unreadable and g.finish_reason != "error":
        g = Generation(g.text, "error", g.token_ids, g.num_tokens, error=answer.unreadable)
    if answer.unclosed and g.finish_reason != "error":  # no answer: never kept as if the reasoning had ended
        counts.turns_reasoning_unclosed += 1
        counts.turns_truncated += g.finish_reason == "length"
        s.flags.append(f"turn {turn}: reasoning not closed" + (" (truncated)" if g.finish_reason == "length" else ""))
        s.finish_reasons.append(g.finish_reason)
        s.token_ids.append(list(g.token_ids) if g.token_ids is not None else [])
        s.status = "truncated"
        return
    message = {"role": "assistant", "content": answer.content}
    if answer.thinking is not None:  # a channel template's reasoning, where its template reads it
        message["thinking"] = answer.thinking
    if g.tool_calls:
        message["tool_calls"] = [c.to_dict() for c in g.tool_calls]
    s.built.append(message)
    s.finish_reasons.append(g.finish_reason)
    s.token_ids.append(list(g.token_ids) if g.token_ids is not None else [])
    if g.finish_reason == "error":
        counts.turns_failed += 1
        s.status = "failed"
        s.flags.append(f"turn {turn}: failed: {g.error}")
    elif not answer.content.strip() and not g.tool_calls:
        counts.turns_empty += 1
        s.flags.append(f"turn {turn}: empty")
        s.status = "empty" if cfg.on_empty == "drop" else s.status
    elif g.finish_reason == "loop":
        counts.turns_loop_trimmed += 1
        s.flags.append(f"turn {turn}: loop trimmed")
    elif g.finish_reason == "length":
        counts.turns_truncated += 1
        s.flags.append(f"turn {turn}: truncated")
        s.status = "truncated" if cfg.on_truncated == "drop" else s.status
    else:
        counts.turns_ok += 1

def prompt_opens_reasoning(tokenizer, s: ConversationState) -> bool:
    """Whether the generation prompt of s's next turn (its history so far, rendered in its mode)
    leaves a <think> block open, so that the text generated starts inside it (no tokenizer, as with
    a server without a local one: the text says for itself)."""
    if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
        return False
    extra = {**s.mode["chat_template_kwargs"], **({"tools": list(s.conv.tools)} if s.conv.tools else {})}
    return opens_reasoning(tokenizer.apply_chat_template(s.built, add_generation_prompt=True, tokenize=False, **extra))


def keep_recorded(cfg, s: ConversationState, recorded: Message, turn: int, counts: ShardCounts) -> None:
    """The target's calls differ from the record's (or it called a tool where the record
    answers): the recorded turn goes into the history, or the conversation is dropped."""
    if recorded.tool_calls and cfg.on_tool_mismatch == "drop":
        s.status = "tool_mismatch"
        return
    if recorded.tool_calls:
        s.tool_exchanges["replaced"] += 1
        s.flags.append(f"turn {turn}: recorded tool calls kept")
    else:
        counts.tool_calls_unrecorded += 1
        s.flags.append(f"turn {turn}: recorded answer kept (the target called a tool)")
    s.built.append(recorded.to_dict())
    s.finish_reasons.append("recorded")
    s.token_ids.append([])

def trim_loop(tokenizer, g: Generation, counts: ShardCounts) -> Generation:
    """`g` cut after the first repeat of the loop it ends in (finish reason 'loop'), or `g`
    itself when it ends in no loop or the backend gave no token ids to look at.

    Later turns are generated on the trimmed text, so the history stays what the target saw.
    Capture's soft targets come from the target's own logits at every position, so the cut
    teaches the draft nothing false: at the cut the target still predicts the loop going on."""
    cut = loop_cut(g.token_ids) if g.token_ids is not None and tokenizer is not None else None
    if cut is None:
        return g
    counts.loop_tokens_removed += g.num_tokens - cut
    kept = tuple(g.token_ids[:cut])
    return Generation(tokenizer.decode(kept), "loop", kept, len(kept))
