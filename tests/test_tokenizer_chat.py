"""Tokenizers (built-in and tokenizer.json) and the ChatML template with tool-call markup."""

import json

import pytest

from tiderl_jax.model import chat
from tiderl_jax.model.config import ConfigError
from tiderl_jax.model.tokenizer import CHAT_SPECIAL_TOKENS, Tokenizer

TOK = Tokenizer.builtin()


def test_builtin_round_trips_any_text():
    for text in ["", "plain ascii 12+30=42", "héllo wörld 🙂 中文", "\x00\x7f\n\t  ", "<|im_start|>x"]:
        assert TOK.decode(TOK.encode(text)) == text
    assert TOK.encode("AB") == [65, 66]  # bytes are their own ids


def test_builtin_special_tokens_are_single_ids():
    for i, token in enumerate(CHAT_SPECIAL_TOKENS):
        assert TOK.encode(token) == [256 + i]
    assert TOK.eos_id == TOK.token_id("<|im_end|>") and TOK.pad_id == TOK.token_id("<|pad|>")
    assert TOK.vocab_size == 256 + len(CHAT_SPECIAL_TOKENS)
    assert TOK.decode(TOK.encode("a<|im_end|>b"), skip_special_tokens=True) == "ab"


def test_tokenizer_json_round_trip(tmp_path):
    TOK.save(tmp_path / "tokenizer.json")
    loaded = Tokenizer.from_file(tmp_path)  # a directory holding tokenizer.json works too
    text = "<|im_start|>user\nwhat is 3*4?<|im_end|>"
    assert loaded.encode(text) == TOK.encode(text) and loaded.eos_id == TOK.eos_id


def test_tokenizer_errors_are_named(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        Tokenizer.from_file(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="could not be parsed"):
        Tokenizer.from_file(tmp_path / "bad.json")
    TOK.save(tmp_path / "t.json")
    with pytest.raises(ConfigError, match="has no token '<\\|eot_id\\|>'"):
        Tokenizer.from_file(tmp_path / "t.json", eos_token="<|eot_id|>")


CONVERSATION = [
    chat.Message("system", "Use tools."),
    chat.Message("user", "What is 2+3?"),
    chat.Message("assistant", "Let me compute.", (chat.ToolCall("calc", {"expr": "2+3"}),)),
    chat.Message("tool", "5"),
    chat.Message("assistant", "The answer is 5."),
]


def test_render_uses_chatml_with_qwen_tool_markup():
    assert chat.render(CONVERSATION, add_generation_prompt=True) == (
        "<|im_start|>system\nUse tools.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+3?<|im_end|>\n"
        "<|im_start|>assistant\nLet me compute.\n<tool_call>\n"
        '{"name": "calc", "arguments": {"expr": "2+3"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nThe answer is 5.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_encode_masks_exactly_the_model_tokens():
    enc = chat.encode(TOK, CONVERSATION)
    assert TOK.decode(enc.ids) == chat.render(CONVERSATION)
    model_text = TOK.decode([t for t, m in zip(enc.ids, enc.model_mask) if m])
    assert model_text == ("Let me compute.\n<tool_call>\n"
                          '{"name": "calc", "arguments": {"expr": "2+3"}}\n</tool_call><|im_end|>'
                          "The answer is 5.<|im_end|>")


def test_parse_tool_calls_reads_back_rendered_calls():
    calls = (chat.ToolCall("calc", {"expr": "1+1"}), chat.ToolCall("search", {"q": "x", "k": 2}))
    text = chat.Message("assistant", "thinking", calls).content + "\n" + "\n".join(c.render() for c in calls)
    parsed = chat.parse_tool_calls(text + "<|im_end|>")
    assert parsed.tool_calls == calls and parsed.errors == () and parsed.content == "thinking"


@pytest.mark.parametrize("text, error", [
    ("<tool_call>\n{\"name\": \"calc\", \"arguments\": {\"expr\": }\n</tool_call>", "not valid JSON"),
    ("<tool_call>[1, 2]</tool_call>", 'string "name"'),
    ("<tool_call>{\"arguments\": {}}</tool_call>", 'string "name"'),
    ("<tool_call>{\"name\": \"calc\", \"arguments\": \"2+3\"}</tool_call>", '"arguments" must be an object'),
    ("<tool_call>{\"name\": \"calc\", \"args\": {}}</tool_call>", "unknown keys ['args']"),
    ("answer <tool_call>{\"name\": \"calc\"", "unclosed <tool_call>"),
    ("stray </tool_call>", "without a matching"),
])
def test_malformed_tool_calls_become_errors_not_exceptions(text, error):
    parsed = chat.parse_tool_calls(text)
    assert parsed.tool_calls == () and len(parsed.errors) == 1 and error in parsed.errors[0]


def test_good_and_bad_calls_in_one_turn():
    good = json.dumps({"name": "calc", "arguments": {"expr": "7*6"}})
    parsed = chat.parse_tool_calls(f"<tool_call>{good}</tool_call><tool_call>oops</tool_call>")
    assert parsed.tool_calls == (chat.ToolCall("calc", {"expr": "7*6"}),) and len(parsed.errors) == 1


def test_message_validation():
    with pytest.raises(ValueError, match="role 'robot'"):
        chat.Message("robot", "hi")
    with pytest.raises(ValueError, match="only assistant messages carry tool calls"):
        chat.Message("user", "hi", (chat.ToolCall("calc", {}),))
