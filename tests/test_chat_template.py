"""Checkpoints' chat templates (model/chat_template.py): hand-checked renderings of SmolLM2's template
(ChatML) and of a Llama-3.1-style one, the model-token mask, observation deltas that keep a trajectory
token-in / token-out, the families' tool-call parsers, transformers' jinja environment, named errors."""

import json

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

import smollm2
from test_tokenizer_chat import CONVERSATION  # the built-in ChatML's hand-checked conversation
from tiderl_jax.model import chat, gguf_io
from tiderl_jax.model.chat_template import ChatTemplate, TemplateError, parse_llama3_json, tool_format_of
from tiderl_jax.model.config import ConfigError
from tiderl_jax.model.tokenizer import Tokenizer, _byte_to_unicode

CALL = chat.ToolCall("calc", {"expr": "2+3"})


@pytest.fixture(scope="module")
def smol_tok():
    return gguf_io.read_gguf_tokenizer(gguf_io.open_gguf(smollm2.gguf_path()))


# ------------------------------------------------------------------ SmolLM2 (ChatML, no tool support)


def test_smollm2_template_renders_chatml(smol_tok):
    t = ChatTemplate.for_tokenizer(smol_tok)
    assert t.tool_format == "hermes" and not t.supports_tools and t.stop_ids == (smol_tok.token_id("<|im_end|>"),)
    assert t.render([chat.Message("user", "Hi!")], add_generation_prompt=True) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n")
    # With a system turn, tool calls inline and tool results in <tool_response>: the built-in ChatML exactly.
    assert t.render(CONVERSATION, add_generation_prompt=True) == chat.render(CONVERSATION, add_generation_prompt=True)


def test_smollm2_encode_masks_the_model_tokens(smol_tok):
    t = ChatTemplate.for_tokenizer(smol_tok)
    enc = t.encode(CONVERSATION, add_generation_prompt=True)
    assert smol_tok.decode(enc.ids) == chat.render(CONVERSATION, add_generation_prompt=True)
    assert enc.ids == chat.encode(smol_tok, CONVERSATION, add_generation_prompt=True).ids
    assert smol_tok.decode([i for i, m in zip(enc.ids, enc.model_mask) if m]) == (
        'Let me compute.\n<tool_call>\n{"name": "calc", "arguments": {"expr": "2+3"}}\n</tool_call><|im_end|>'
        "The answer is 5.<|im_end|>")


def test_smollm2_observation_delta(smol_tok):
    t = ChatTemplate.for_tokenizer(smol_tok)
    history, obs = CONVERSATION[:3], [CONVERSATION[3]]
    after_stop = t.observation_ids(history, obs)
    assert smol_tok.decode(after_stop) == ("\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n"
                                           "<|im_start|>assistant\n")
    cut = t.observation_ids(history, obs, model_stopped=False)  # the model ran out of tokens: its turn is closed
    assert cut == [smol_tok.token_id("<|im_end|>")] + after_stop


# ------------------------------------------------------------------ a Llama-3.1-style template

LLAMA31_STYLE = r"""{{- bos_token }}
{%- if date_string is not defined %}
    {%- set date_string = '26 Jul 2024' %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system = '' %}
{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\n\n' }}
{%- if tools is defined and tools is not none %}
    {{- 'Environment: ipython\n' }}
{%- endif %}
{{- 'Today Date: ' + date_string + '\n\n' }}
{%- if tools is defined and tools is not none %}
    {{- 'Call a function by replying with JSON {"name": function name, "parameters": its arguments}.\n\n' }}
    {%- for t in tools %}
        {{- t | tojson(indent=2) + '\n\n' }}
    {%- endfor %}
{%- endif %}
{{- system + '<|eot_id|>' }}
{%- for m in messages %}
    {%- if m['role'] == 'assistant' and m['tool_calls'] is defined %}
        {%- if m['tool_calls'] | length != 1 %}
            {{- raise_exception('one tool call per turn') }}
        {%- endif %}
        {%- set f = m['tool_calls'][0]['function'] %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
        {{- '{"name": "' + f['name'] + '", "parameters": ' + f['arguments'] | tojson + '}<|eot_id|>' }}
    {%- elif m['role'] == 'tool' or m['role'] == 'ipython' %}
        {{- '<|start_header_id|>ipython<|end_header_id|>\n\n' + m['content'] + '<|eot_id|>' }}
    {%- else %}
        {{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""
LLAMA_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                  "<|eom_id|>", "<|python_tag|>"]


def _llama_tok(template=LLAMA31_STYLE):
    vocab = {ch: b for b, ch in _byte_to_unicode().items()}
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(LLAMA_SPECIALS)
    return Tokenizer(tok, eos_token="<|end_of_text|>", bos_token="<|begin_of_text|>",
                     stop_tokens=["<|eot_id|>", "<|eom_id|>"], chat_template=template, source="llama-style")


TOOLS = [{"name": "calc"}]
LLAMA_CONV = [CONVERSATION[0], CONVERSATION[1], chat.Message("assistant", "", (CALL,)), CONVERSATION[3],
              CONVERSATION[4]]


def test_llama31_style_rendering_and_stop_tokens():
    tok = _llama_tok()
    t = ChatTemplate(tok, LLAMA31_STYLE, extra_context={"date_string": "26 Jul 2024"})
    assert t.tool_format == "llama3_json" and t.supports_tools
    assert [tok.decode([i]) for i in t.stop_ids] == ["<|end_of_text|>", "<|eot_id|>", "<|eom_id|>"]
    assert t.render(LLAMA_CONV, tools=TOOLS) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Environment: ipython\nToday Date: 26 Jul 2024\n\n"
        'Call a function by replying with JSON {"name": function name, "parameters": its arguments}.\n\n'
        '{\n  "name": "calc"\n}\n\n'
        "Use tools.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+3?<|eot_id|>"
        '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "calc", "parameters": {"expr": "2+3"}}<|eot_id|>'
        "<|start_header_id|>ipython<|end_header_id|>\n\n5<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nThe answer is 5.<|eot_id|>")
    enc = t.encode(LLAMA_CONV, tools=TOOLS)
    assert tok.decode([i for i, m in zip(enc.ids, enc.model_mask) if m]) == (
        '{"name": "calc", "parameters": {"expr": "2+3"}}<|eot_id|>The answer is 5.<|eot_id|>')


def test_llama31_style_trajectory_is_token_in_token_out():
    """prompt + the model's tokens as sampled + the observation delta + the model's next tokens is the
    template's encoding of the whole conversation; the sampled turn is parsed, never re-tokenized."""
    tok = _llama_tok()
    t = ChatTemplate(tok, LLAMA31_STYLE, extra_context={"date_string": "26 Jul 2024"})
    ids = t.encode(LLAMA_CONV[:2], add_generation_prompt=True, tools=TOOLS).ids
    sampled = tok.encode('{"name": "calc", "parameters": {"expr": "2+3"}}<|eot_id|>')
    turn = t.parse_tool_calls(tok.decode(sampled))
    assert turn.tool_calls == (CALL,) and turn.errors == ()
    history = LLAMA_CONV[:2] + [chat.Message("assistant", turn.content, turn.tool_calls)]
    obs = t.observation_ids(history, [chat.Message("tool", "5")], tools=TOOLS)
    assert tok.decode(obs) == ("<|start_header_id|>ipython<|end_header_id|>\n\n5<|eot_id|>"
                               "<|start_header_id|>assistant<|end_header_id|>\n\n")
    ids += sampled + obs + tok.encode("The answer is 5.<|eot_id|>")
    assert ids == t.encode(LLAMA_CONV, tools=TOOLS).ids


def test_template_that_rewrites_history_is_refused():
    """A template that drops earlier turns (here: keeps only the last two messages) cannot give deltas."""
    last_two = "{% for m in messages[-2:] %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>{{ m['content'] }}" \
               "<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>{% endif %}"
    t = ChatTemplate(_llama_tok(last_two), last_two)
    history = [chat.Message("user", "a"), chat.Message("assistant", "b")]
    with pytest.raises(TemplateError, match="rewrites the earlier rendering"):
        t.observation_ids(history, [chat.Message("user", "c")])


# ------------------------------------------------------------------ parsers


def test_llama3_json_tool_calls():
    assert parse_llama3_json('{"name": "calc", "parameters": {"expr": "2+3"}}').tool_calls == (CALL,)
    two = parse_llama3_json('<|python_tag|>{"name": "calc", "arguments": {"expr": "2+3"}}; '
                            '{"name": "search", "parameters": {"query": "x"}}')
    assert two.tool_calls == (CALL, chat.ToolCall("search", {"query": "x"})) and two.errors == ()
    trailing = parse_llama3_json('{"name": "calc", "parameters": {"expr": "2+3"}} and more')
    assert trailing.tool_calls == (CALL,) and trailing.errors == ("text after a tool call: 'and more'",)
    plain = parse_llama3_json("The answer is 5.")
    assert plain.content == "The answer is 5." and plain.tool_calls == () and plain.errors == ()


@pytest.mark.parametrize("text, error", [
    ('{"name": "calc", "parameters": {"expr": }', "not valid JSON"),
    ('{"parameters": {}}', 'string "name"'),
    ('{"name": "calc", "parameters": "2+3"}', '"parameters" must be an object'),
    ('{"name": "calc", "params": {}}', "unknown keys ['params']"),
    ('{"name": "calc", "parameters": {}, "arguments": {}}', "both"),
    ("<|python_tag|>print(1)", "must be followed by a JSON tool call"),
])
def test_malformed_llama3_calls_become_errors(text, error):
    parsed = parse_llama3_json(text)
    assert parsed.tool_calls == () and len(parsed.errors) == 1 and error in parsed.errors[0]


def test_hermes_calls_through_a_template(smol_tok):
    """ChatML / Qwen2.5 `<tool_call>` JSON: the built-in parser, the checkpoint's stop token stripped."""
    qwen_like = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}" \
                "{# <tool_call> #}{{ tools is defined }}"
    assert tool_format_of(qwen_like) == "hermes" and tool_format_of(LLAMA31_STYLE) == "llama3_json"
    t = ChatTemplate(smol_tok, qwen_like)
    out = t.parse_tool_calls('Let me compute.\n<tool_call>\n{"name": "calc", "arguments": {"expr": "2+3"}}\n'
                             '</tool_call><|im_end|>')
    assert out.tool_calls == (CALL,) and out.content == "Let me compute." and out.errors == ()


# ------------------------------------------------------------------ the jinja environment, errors


def test_transformers_jinja_environment():
    tok = _llama_tok()
    src = ("{% for m in messages %}\n  {% if loop.index > 2 %}{% break %}{% endif %}\n"
           "  {% generation %}{{ m['content'] | tojson }}{% endgeneration %}\n{% endfor %}"
           "{{ strftime_now('%Y') | length }}")
    assert ChatTemplate(tok, src).render([chat.Message("user", "é"), chat.Message("user", "b"),
                                          chat.Message("user", "c")]) == '"é""b"4'  # trimmed, unescaped
    bad = ChatTemplate(tok, "{{ raise_exception('only user turns') }}")
    with pytest.raises(TemplateError, match="only user turns"):
        bad.render([chat.Message("user", "x")])
    with pytest.raises(TemplateError, match="does not compile"):
        ChatTemplate(tok, "{% for m in messages %}")
    with pytest.raises(TemplateError, match="cannot open with an assistant"):
        ChatTemplate(tok, LLAMA31_STYLE, extra_context={"date_string": "x"}).encode([chat.Message("assistant", "x")])
    assert ChatTemplate.for_tokenizer(Tokenizer.builtin()) is None  # the built-in ChatML applies


def test_checkpoint_tokenizer_files(tmp_path, smol_tok):
    """tokenizer_config.json / generation_config.json: the eos, bos, template and stop ids a checkpoint ships."""
    tok = _llama_tok()
    tok.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [tok.token_id("<|end_of_text|>"), tok.token_id("<|eom_id|>"), tok.token_id("<|eot_id|>")]}))
    loaded = Tokenizer.from_checkpoint(tmp_path)
    assert loaded.chat_template == LLAMA31_STYLE and loaded.bos_id == tok.bos_id
    assert sorted(loaded.stop_ids) == sorted(tok.stop_ids) and loaded.eos_token == "<|end_of_text|>"
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": 99999}')
    with pytest.raises(ConfigError, match="eos_token_id 99999 is not in the vocabulary"):
        Tokenizer.from_checkpoint(tmp_path)
    builtin = Tokenizer.builtin()
    assert builtin.stop_ids == (builtin.eos_id,) and builtin.chat_template is None and builtin.bos_id is None
