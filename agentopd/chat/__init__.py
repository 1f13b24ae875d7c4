"""The chat layer: templates, a locally built tokenizer, the tool-call parser, exact token-stream
assembly and the drift checker.

    from agentopd.chat import StreamBuilder, parse_assistant, check_episode, build_tokenizer
"""

from agentopd.chat.drift import DriftReport, Finding, FindingKind, Severity, check_episode, check_stored_episode, format_report
from agentopd.chat.parser import ParsedTurn, assistant_turn_text, parse_assistant
from agentopd.chat.stream import (
    TRUNCATION_MARKER,
    ContextFull,
    ObservationSegment,
    StreamBuilder,
    TemplateMismatch,
    cap_tool_text,
)
from agentopd.chat.template import DEFAULT_CHAT_TEMPLATE, chat_template_of, encode, render, to_template_messages
from agentopd.chat.tokenizer import EOS_TOKEN, PAD_TOKEN, SPECIAL_TOKENS, build_tokenizer

__all__ = [
    "DEFAULT_CHAT_TEMPLATE",
    "EOS_TOKEN",
    "PAD_TOKEN",
    "SPECIAL_TOKENS",
    "TRUNCATION_MARKER",
    "ContextFull",
    "DriftReport",
    "Finding",
    "FindingKind",
    "ObservationSegment",
    "ParsedTurn",
    "Severity",
    "StreamBuilder",
    "TemplateMismatch",
    "assistant_turn_text",
    "build_tokenizer",
    "cap_tool_text",
    "chat_template_of",
    "check_episode",
    "check_stored_episode",
    "encode",
    "format_report",
    "parse_assistant",
    "render",
    "to_template_messages",
]
