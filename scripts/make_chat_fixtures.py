#!/usr/bin/env python3
"""Build the chat-template fixtures: what Hugging Face's Jinja environment renders for small
templates, and what transformers' apply_chat_template renders and tokenizes for realistic chat
templates, so keel's Jinja subset (data/jinja.h) and chat templates (data/chat_template.h) can be
checked against the Python originals character for character and id for id.

Outputs (test/fixtures/chat/):
  jinja_cases.json   {"generated_by", "cases": [{"name", "group", "template", "context", "output"} or
                     {..., "error", "error_type"}]}: about 400 small templates, ordered by feature group
                     (whitespace, values, literals, operators, subscript, methods, control, filters,
                     tests, globals, errors), each rendered with HF's environment exactly:
                     transformers.utils.chat_template_utils._compile_jinja_template(template)
                     .render(**context) (ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks,
                     loopcontrols, HF's tojson, raise_exception, dict, namespace). "error" is str() of
                     the exception (compile or render), "error_type" its class name. Contexts are
                     JSON objects (a case's context is the JSON round trip of what was rendered).
  tokenizer.json     a byte-level BPE (Llama 3 style: Split(Llama 3 regex) + ByteLevel without its
                     regex, ByteLevel decoder, no post-processor) trained here on a generated English
                     corpus (1500 ids) with the chat families' special tokens as added tokens (ids 0-23)
  templates.json     {"generated_by", "tokenizer", "notes", "templates": {name: {"template",
                     "special_tokens", "conversations": [{"name", "messages", "tools"?, "extra"?,
                     "add_generation_prompt", "text", "ids"} or {..., "error", "error_type"}]}}};
                     templates written here in the style of Llama 3, Llama 3.1 (tools), ChatML,
                     Qwen 2.5 (tools), Qwen 3 (thinking), Mistral, Llama 2, Gemma and Phi-3; text is
                     tokenizer.apply_chat_template(messages, tools=..., add_generation_prompt=...,
                     tokenize=False, **extra), ids the same with tokenize=True (checked here to equal
                     tokenizer(text, add_special_tokens=False)["input_ids"])
  config_cases.json  tokenizer_config.json and tokenizer_config_list.json loaded with
                     AutoTokenizer.from_pretrained next to tokenizer.json, and what they render (the
                     list form picks "tool_use" when tools are given, else "default"); transformers 5
                     refuses the eos AddedToken dict without "__type": "AddedToken": recorded as
                     load_error, then loaded with that key added
  tokenizer_config.json       {"chat_template": llama3, "bos_token": a string, "eos_token": an
                              AddedToken dict, "tokenizer_class"}
  tokenizer_config_list.json  "chat_template" as [{"name": "default", "template": chatml},
                              {"name": "tool_use", "template": chatml_qwen25}]
  chat.jsonl         40 {"messages": [...]} lines (system/user/assistant, 1-3 turns, ending with an
                     assistant message, non-ASCII, newlines; some lines with \\u escapes) valid for the
                     llama3 and chatml_qwen25 templates (not for gemma: some have a system message)
  chat_rendered.json chat.jsonl rendered and tokenized with the llama3 and chatml_qwen25 templates
  chat_bad.jsonl     a valid record, a record whose "messages" is not a list, one without "messages"

Needs jinja2 3.1.6, transformers 5.23.0, tokenizers 0.23.3 (torch not needed). Exception messages
come from CPython (3.11 here) and may change with its version. Deterministic: --check rebuilds into
a temporary folder and compares bytes, exit status 1 on any difference.

  python3 scripts/make_chat_fixtures.py [--check]
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
import warnings

import jinja2
import tokenizers
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast
from transformers.utils.chat_template_utils import _compile_jinja_template

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fixture_cli  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
GENERATED_BY = f"scripts/make_chat_fixtures.py with jinja2 {jinja2.__version__} and transformers {transformers.__version__}"


def dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, indent=1) + "\n"


# --------------------------------------------------------------------------------------------
# jinja_cases.json
# --------------------------------------------------------------------------------------------

MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]
XS = [1, 2, 3, 4]
D = {"k": "v", "n": 2, "a": {"b": [0, {"c": "deep"}]}}
PEOPLE = [{"name": "Ann", "age": 31}, {"name": "bob", "age": 25}, {"name": "Cy", "age": 40}]

WHITESPACE = [
    ("ws_plain", "Hello {{ name }}!", {"name": "World"}),
    ("ws_empty_template", "", {}),
    ("ws_only_newline", "\n", {}),
    ("ws_text_spaces_kept", "a   b\t\tc  ", {}),
    ("ws_whitespace_only", "  \n  ", {}),
    ("ws_block_minus_left", "a  \n {%- if true %}b{% endif %}", {}),
    ("ws_block_minus_right", "{% if true -%} \n\t b{% endif %}", {}),
    ("ws_block_minus_both", "a\n\n{%- if true -%}\n\nb\n\n{%- endif -%}\n\nc", {}),
    ("ws_expr_minus", "a \n {{- x -}} \n b", {"x": "X"}),
    ("ws_expr_minus_left_only", "a \n\t{{- 'b' }} \n c", {}),
    ("ws_expr_minus_right_only", "a \n{{ 'b' -}} \n\n c", {}),
    ("ws_expr_minus_no_spaces", "a {{-x-}} b", {"x": "X"}),
    ("ws_comment_minus", "a  {#- note -#}  b", {}),
    ("ws_plus_disables_lstrip", "  {%+ if true %}x{% endif %}", {}),
    ("ws_plus_disables_trim", "{% if true +%}\nx{% endif %}", {}),
    ("ws_trim_blocks", "{% if true %}\nx\n{% endif %}\ny", {}),
    ("ws_trim_blocks_one_newline", "{% if true %}\n\nx{% endif %}", {}),
    ("ws_trim_blocks_spaces_before_newline", "{% if true %}  \nx{% endif %}", {}),
    ("ws_no_trim_after_expr", "{{ 'a' }}\nb", {}),
    ("ws_trim_after_comment", "{# c #}\nx", {}),
    ("ws_trim_after_comment_midline", "a {# c #}\nb", {}),
    ("ws_comment_multiline", "{#\n multi\n line\n#}\nx", {}),
    ("ws_lstrip_block", "  {% if true %}x{% endif %}", {}),
    ("ws_lstrip_tabs", "\t \t{% if true %}x{% endif %}", {}),
    ("ws_lstrip_not_expr", "  {{ 'x' }}", {}),
    ("ws_lstrip_not_midline", "a  {% if true %}x{% endif %}", {}),
    ("ws_lstrip_comment", "  {# c #}x", {}),
    ("ws_lstrip_after_newline", "a\n  {% if true %}x{% endif %}", {}),
    ("ws_lstrip_unicode_spaces", "a\n\u00a0\u3000{% if true %}x{% endif %}", {}),
    ("ws_lstrip_end_tag", "{% if true %}\n  x\n  {% endif %}\ny", {}),
    ("ws_lstrip_first_line", "   {% if true %}a{% endif %}", {}),
    ("ws_lstrip_with_minus", "  {%- if true %}x{% endif %}", {}),
    ("ws_lstrip_blank_line_before", "a\n\n    {% if true %}\n    b\n    {% endif %}\nc", {}),
    ("ws_tag_at_start", "{% if true %}\n  x\n{% endif %}", {}),
    ("ws_for_lines", "{% for x in xs %}\n  {{ x }}\n{% endfor %}\n", {"xs": [1, 2]}),
    ("ws_for_indented", "<ul>\n  {% for x in xs %}\n  <li>{{ x }}</li>\n  {% endfor %}\n</ul>", {"xs": [1, 2]}),
    ("ws_for_minus_inside", "{% for x in xs -%}\n  {{ x }}\n{%- endfor %}", {"xs": [1, 2]}),
    ("ws_set_line", "{% set x = 1 %}\n{{ x }}\n", {}),
    ("ws_expr_lines", "{{ 1 }}\n{{ 2 }}\n", {}),
    ("ws_chat_style", "{%- for m in messages %}\n    {{- m.role + ': ' + m.content + '\\n' }}\n{%- endfor %}\n",
     {"messages": MSGS[1:3]}),
    ("ws_chat_style_no_minus", "{% for m in messages %}\n    {{ m.role }}: {{ m.content }}\n{% endfor %}\n",
     {"messages": MSGS[1:3]}),
    ("ws_trailing_newline_dropped", "x\n", {}),
    ("ws_two_trailing_newlines", "x\n\n", {}),
    ("ws_trailing_newline_after_block", "{% if true %}x{% endif %}\n", {}),
    ("ws_trailing_newline_after_expr", "{{ 'x' }}\n", {}),
    ("ws_crlf_text", "a\r\nb\r\n", {}),
    ("ws_crlf_trim_blocks", "{% if true %}\r\nx\r\n{% endif %}\r\ny", {}),
    ("ws_crlf_lstrip", "a\r\n  {% if true %}x{% endif %}", {}),
    ("ws_cr_newlines", "a\rb{% if true %}\rc{% endif %}\r", {}),
    ("ws_crlf_in_string_literal", "{{ 'a\r\nb' }}", {}),
    ("ws_crlf_in_context_kept", "{{ s }}", {"s": "a\r\nb\rc"}),
    ("ws_minus_unicode_spaces", "a\u00a0{{- 'b' -}}\u3000c", {}),
    ("ws_minus_unicode_block", "a\u2003\n{%- if true -%}\u00a0\u2028b{% endif %}", {}),
    ("ws_minus_zero_width_kept", "a\u200b{{- 'b' -}}\u200bc", {}),
]

VALUES = [
    ("val_none", "{{ x }}", {"x": None}),
    ("val_true_false", "{{ t }} {{ f }}", {"t": True, "f": False}),
    ("val_int", "{{ x }}", {"x": 42}),
    ("val_negative_int", "{{ x }}", {"x": -7}),
    ("val_zero", "{{ x }}", {"x": 0}),
    ("val_int_above_2_53", "{{ x }}", {"x": 9007199254740993}),
    ("val_float_one", "{{ x }}", {"x": 1.0}),
    ("val_float_tenth", "{{ x }}", {"x": 0.1}),
    ("val_float_1e20", "{{ x }}", {"x": 1e20}),
    ("val_float_1e16", "{{ x }}", {"x": 1e16}),
    ("val_float_1e15", "{{ x }}", {"x": 1e15}),
    ("val_float_1e-7", "{{ x }}", {"x": 1e-7}),
    ("val_float_small", "{{ x }} {{ y }}", {"x": 2.5e-05, "y": 0.0001}),
    ("val_float_large", "{{ x }}", {"x": 123456789012345678.0}),
    ("val_float_negative_zero", "{{ x }}", {"x": -0.0}),
    ("val_float_pi", "{{ x }}", {"x": 3.14159}),
    ("val_float_huge", "{{ x }}", {"x": 1.5e300}),
    ("val_float_literals", "{{ 1.0 }} {{ 0.1 }} {{ 1e20 }} {{ 1e-7 }} {{ 2.5e-05 }} {{ 123456789012345678.0 }}", {}),
    ("val_string", "{{ s }}", {"s": "héllo 世界 😀"}),
    ("val_list", "{{ xs }}", {"xs": ["a", 1, None, True]}),
    ("val_list_nested", "{{ xs }}", {"xs": [[1, 2], [], {"a": None}, [[]]]}),
    ("val_list_floats", "{{ xs }}", {"xs": [1.0, 1e-7, -0.0, 1e20, 0.5]}),
    ("val_list_bools", "{{ xs }}", {"xs": [True, False, None]}),
    ("val_empty_list_dict", "{{ a }} {{ b }}", {"a": [], "b": {}}),
    ("val_dict", "{{ d }}", {"d": {"b": 1, "a": [1.5, "x"], "c": {"d": None, "e": False}}}),
    ("val_repr_single_quote", "{{ xs }}", {"xs": ["it's"]}),
    ("val_repr_double_quote", "{{ xs }}", {"xs": ['say "hi"']}),
    ("val_repr_both_quotes", "{{ xs }}", {"xs": ["it's \"q\""]}),
    ("val_repr_newline_tab", "{{ xs }}", {"xs": ["a\nb", "c\td", "e\rf"]}),
    ("val_repr_backslash", "{{ xs }}", {"xs": ["a\\b", "\\'", "\\"]}),
    ("val_repr_non_ascii", "{{ xs }}", {"xs": ["é日本😀", "Ω"]}),
    ("val_repr_control", "{{ xs }}", {"xs": ["\x01", "\x7f", "\x1b[0m", "\x00"]}),
    ("val_repr_unicode_space", "{{ xs }}", {"xs": ["\u00a0", "\u3000", "\u200b", "\u2028", "\u0085", "\ufeff"]}),
    ("val_repr_dict_keys", "{{ d }}", {"d": {"it's": "v", "k\n": "é"}}),
    ("val_undefined", "[{{ missing }}]", {}),
    ("val_tuple", "{{ (1, 'a') }} {{ (1,) }} {{ () }}", {}),
    ("val_string_in_text", "a{{ s }}b", {"s": ""}),
]

LITERALS = [
    ("lit_single_quote_escape", "{{ 'it\\'s' }}", {}),
    ("lit_double_quote_escape", '{{ "say \\"hi\\"" }}', {}),
    ("lit_quote_inside_other", "{{ \"it's\" }} {{ 'say \"hi\"' }}", {}),
    ("lit_escape_newline", "{{ 'a\\nb' }}", {}),
    ("lit_escape_tab", "{{ 'a\\tb' }}", {}),
    ("lit_escape_backslash", "{{ 'a\\\\b' }}", {}),
    ("lit_escape_u", "{{ '\\u00e9\\u65e5' }}", {}),
    ("lit_escape_x", "{{ '\\x41\\x7e' }}", {}),
    ("lit_escape_unknown", "{{ 'a\\db' }}", {}),
    ("lit_escape_octal", "{{ '\\101' }}", {}),
    ("lit_raw_non_ascii", "{{ 'é日本😀' }}", {}),
    ("lit_raw_newline_in_literal", "{{ 'a\nb' }}", {}),
    ("lit_adjacent_concat", "{{ 'a' 'b' \"c\" }}", {}),
    ("lit_empty_string", "[{{ '' }}]", {}),
    ("lit_braces_in_string", "{{ '{{ x }}' }}", {}),
    ("lit_int_underscores", "{{ 1_000_000 }}", {}),
    ("lit_float", "{{ 1.5 }} {{ 1.5e3 }} {{ 2e-3 }} {{ 1_0.5 }} {{ 0.0 }}", {}),
    ("lit_int_bases", "{{ 0x1F }} {{ 0o17 }} {{ 0b101 }}", {}),
    ("lit_negative", "{{ -1.5 }} {{ -0 }}", {}),
    ("lit_list", "{{ [1, 'a', [2]] }}", {}),
    ("lit_list_trailing_comma", "{{ [1, 2,] }}", {}),
    ("lit_tuple", "{{ (1, 2) }} {{ (1) }}", {}),
    ("lit_dict", "{{ {'a': 1, 'b': [2]} }}", {}),
    ("lit_dict_double_quoted_key", "{{ {\"k\": 'v'} }}", {}),
    ("lit_dict_int_key", "{{ {1: 'a'} }}", {}),
    ("lit_bool_none", "{{ true }} {{ True }} {{ false }} {{ False }} {{ none }} {{ None }}", {}),
]

OPERATORS = [
    ("op_add_sub", "{{ 7 + 3 }} {{ 7 - 10 }}", {}),
    ("op_mul", "{{ 2 * 3 }} {{ 2 * 1.5 }}", {}),
    ("op_div", "{{ 7 / 2 }} {{ 6 / 2 }} {{ 1 / 3 }}", {}),
    ("op_floordiv", "{{ 7 // 2 }} {{ -7 // 2 }} {{ 7 // -2 }}", {}),
    ("op_mod", "{{ 7 % 3 }} {{ -7 % 3 }} {{ 7 % -3 }}", {}),
    ("op_float_floordiv_mod", "{{ 7.5 // 2 }} {{ -7.5 // 2 }} {{ 7.5 % 2 }} {{ -7.5 % 2 }}", {}),
    ("op_pow", "{{ 2 ** 10 }} {{ 2 ** -1 }} {{ 2.0 ** 3 }} {{ 2 ** 62 }}", {}),
    ("op_int_float_mix", "{{ 1 + 1.0 }} {{ 0.1 + 0.2 }} {{ 3 * 0.1 }}", {}),
    ("op_vars", "{{ a + b }} {{ a * b }} {{ a - b }}", {"a": 6, "b": 4}),
    ("op_string_add", "{{ 'a' + 'b' }} {{ s + '!' }}", {"s": "hé"}),
    ("op_list_add", "{{ [1] + [2, 3] }} {{ xs + [] }}", {"xs": ["a"]}),
    ("op_string_mul", "{{ 'ab' * 3 }} {{ 3 * 'ab' }} [{{ '-' * 0 }}]", {}),
    ("op_list_mul", "{{ [1] * 2 }}", {}),
    ("op_tilde", "{{ 1 ~ 2 }}|{{ 'a' ~ none }}|{{ true ~ 1.0 }}|{{ missing ~ 'x' }}|{{ [1] ~ '' }}", {}),
    ("op_compare", "{{ 1 < 2 }} {{ 2 <= 2 }} {{ 3 > 4 }} {{ 3 >= 4 }} {{ 'a' < 'b' }} {{ 'B' < 'a' }}", {}),
    ("op_compare_chained", "{{ 1 < 2 < 3 }} {{ 3 > 2 > 2 }} {{ 1 < 3 > 2 }}", {}),
    ("op_eq_across_types", "{{ 1 == 1.0 }} {{ 1 == '1' }} {{ 'a' == 'a' }} {{ [1, 2] == [1, 2] }} "
     "{{ {'a': 1} == {'a': 1} }} {{ none == none }} {{ true == 1 }} {{ 0 == false }} {{ none == 0 }}", {}),
    ("op_ne", "{{ 1 != 2 }} {{ 'a' != 'a' }} {{ [1] != [1.0] }} {{ none != false }}", {}),
    ("op_compare_sequences", "{{ [1, 2] < [1, 3] }} {{ 'abc' < 'abd' }} {{ 'é' > 'z' }}", {}),
    ("op_in_string", "{{ 'b' in 'abc' }} {{ 'x' not in 'abc' }} {{ '' in 'abc' }}", {}),
    ("op_in_list", "{{ 2 in [1, 2] }} {{ 3 not in [1, 2] }} {{ 1.0 in [1] }} {{ 'a' in ['ab'] }}", {}),
    ("op_in_dict", "{{ 'a' in d }} {{ 'z' in d }} {{ 1 in d }}", {"d": {"a": 1}}),
    ("op_in_message", "{{ 'tool_calls' in m }} {{ 'content' in m }}", {"m": MSGS[1]}),
    ("op_or_value", "{{ 0 or 'x' }}|{{ 'a' or 'b' }}|{{ none or [] }}|{{ '' or 0 }}", {}),
    ("op_and_value", "{{ 'a' and 'b' }}|{{ '' and 'b' }}|{{ 0 and 1 }}|{{ [] and 1 }}", {}),
    ("op_not", "{{ not 0 }} {{ not 'a' }} {{ not [] }} {{ not none }} {{ not missing }}", {}),
    ("op_unary", "{{ -x }} {{ -(-3) }} {{ +3 }} {{ -0.0 }} {{ - 1.5 }}", {"x": 3}),
    ("op_cond", "{{ 'a' if true else 'b' }}|{{ 'a' if false else 'b' }}", {}),
    ("op_cond_no_else", "[{{ 'a' if false }}]", {}),
    ("op_cond_nested", "{{ 'a' if false else 'b' if true else 'c' }}", {}),
    ("op_cond_undefined", "{{ 'y' if missing else 'n' }}", {}),
    ("op_prec_arith", "{{ 1 + 2 * 3 }} {{ (1 + 2) * 3 }} {{ 10 - 2 - 3 }} {{ 2 * 3 ** 2 }} {{ 7 - 6 / 2 }}", {}),
    ("op_prec_neg_pow", "{{ -2 ** 2 }}", {}),
    ("op_pow_left_assoc", "{{ 2 ** 3 ** 2 }}", {}),
    ("op_prec_not_eq", "{{ not a == b }}", {"a": 1, "b": 2}),
    ("op_prec_not_in", "{{ not 'a' in 'abc' }}", {}),
    ("op_prec_and_or", "{{ true or false and false }} {{ (true or false) and false }}", {}),
    ("op_prec_tilde_mul", "{{ 'a' ~ 2 * 3 }}", {}),
    ("op_prec_tilde_paren", "{{ 'a' ~ (1 + 2) }}", {}),
    ("op_prec_tilde_add", "{{ 1 ~ 2 + 3 ~ 4 }}", {}),
    ("op_prec_filter_after_neg", "{{ -x|abs }} {{ -(x|abs) }}", {"x": 3}),
    ("op_prec_filter_add", "{{ 1 + x|abs }}", {"x": -3}),
    ("op_prec_filter_tilde", "{{ 'abc'|upper ~ 'd' }} {{ 'a' ~ 'bc'|upper }}", {}),
    ("op_prec_test_and", "{{ x is defined and x > 1 }} {{ y is defined and y > 1 }}", {"x": 2}),
    ("op_prec_cond_or", "{{ 'x' if a or b else 'y' }}", {"a": 0, "b": 1}),
]

SUBSCRIPT = [
    ("sub_dict_bracket", "{{ d['k'] }}", {"d": D}),
    ("sub_dict_dot", "{{ d.k }} {{ d.n + 1 }}", {"d": D}),
    ("sub_dict_nested", "{{ d.a.b[1].c }} {{ d['a']['b'][0] }}", {"d": D}),
    ("sub_missing_key", "[{{ d['nope'] }}][{{ d.nope }}]", {"d": D}),
    ("sub_missing_key_defined", "{{ d.nope is defined }} {{ d['k'] is defined }} {{ d.nope is undefined }}", {"d": D}),
    ("sub_missing_key_falsy", "{% if d.nope %}y{% else %}n{% endif %}{% if not d['nope'] %}!{% endif %}", {"d": D}),
    ("sub_key_named_like_method", "{{ d['items'] }} {{ d['keys'] }} {{ d.count }}", {"d": {"items": "x", "keys": 1, "count": 5}}),
    ("sub_list_index", "{{ xs[0] }} {{ xs[-1] }} {{ xs[1] }}", {"xs": XS}),
    ("sub_list_out_of_range", "[{{ xs[5] }}] {{ xs[5] is defined }} [{{ xs[-9] }}]", {"xs": XS}),
    ("sub_list_slices", "{{ xs[1:] }} {{ xs[::-1] }} {{ xs[:-1] }} {{ xs[1:3] }} {{ xs[::2] }} {{ xs[10:] }}", {"xs": XS}),
    ("sub_list_index_var", "{{ xs[i] }} {{ xs[i + 1] }}", {"xs": XS, "i": 1}),
    ("sub_string_index", "{{ s[0] }}{{ s[1] }}{{ s[-1] }} {{ s[12] }}", {"s": "héllo wörld 日本"}),
    ("sub_string_slice", "{{ s[1:5] }}|{{ s[::-1] }}|{{ s[-2:] }}|{{ s[:0] }}", {"s": "héllo wörld 日本"}),
    ("sub_none_attr", "[{{ n.attr }}] {{ n.attr is defined }} [{{ n['k'] }}]", {"n": None}),
    ("sub_messages", "{{ messages[0]['role'] }} {{ messages[-1].content }} {{ messages[1:]|length }}", {"messages": MSGS}),
    ("sub_int_attr_of_string", "[{{ s.nope }}] {{ s.nope is defined }}", {"s": "abc"}),
    ("sub_items_loop", "{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}", {"d": {"b": 1, "a": [2]}}),
    ("sub_items_list", "{{ d.items()|list }}", {"d": {"b": 1, "a": "x"}}),
    ("sub_keys_values", "{{ d.keys()|list }} {{ d.values()|list }}", {"d": {"b": 1, "a": "x"}}),
    ("sub_keys_loop", "{% for k in d.keys() %}{{ k }}{% endfor %}{% for v in d.values() %}{{ v }}{% endfor %}", {"d": {"b": 1, "a": 2}}),
    ("sub_get", "{{ d.get('k') }} {{ d.get('nope') }} {{ d.get('nope', 'd') }} {{ d.get('k', 'd') }}", {"d": D}),
    ("sub_get_is_none", "{{ d.get('nope') is none }} {{ d.get('nope') is defined }}", {"d": D}),
]

METHODS = [
    ("str_strip", "[{{ s.strip() }}][{{ s.lstrip() }}][{{ s.rstrip() }}]", {"s": "  \t a b \n "}),
    ("str_strip_chars", "{{ 'xxaxyx'.strip('x') }} {{ 'xxa'.lstrip('x') }} {{ 'axx'.rstrip('x') }} {{ 'abcba'.strip('ab') }}", {}),
    ("str_strip_newlines_arg", "[{{ s.strip('\\n') }}][{{ s.lstrip('\\n') }}][{{ s.rstrip('\\n') }}]", {"s": "\n\n a \n"}),
    ("str_strip_unicode", "[{{ s.strip() }}]", {"s": "\u00a0\u3000 a \u2003\u2028\u200b"}),
    ("str_split_whitespace", "{{ s.split() }}", {"s": " a  b\tc\n\u3000d "}),
    ("str_split_sep", "{{ 'a,b,,c'.split(',') }}", {}),
    ("str_split_maxsplit", "{{ 'a,b,c'.split(',', 1) }}", {}),
    ("str_split_multichar", "{{ 'a</think>b</think>c'.split('</think>') }}", {}),
    ("str_split_empty", "{{ ''.split(',') }} {{ ''.split() }} {{ 'abc'.split('x') }}", {}),
    ("str_split_think", "[{{ s.split('</think>')[-1].lstrip('\\n') }}][{{ s.split('</think>')[0].split('<think>')[-1].strip('\\n') }}]",
     {"s": "<think>\nhmm\n</think>\n\nanswer"}),
    ("str_startswith_endswith", "{{ s.startswith('ab') }} {{ s.endswith('yz') }} {{ s.startswith('b') }} {{ s.endswith('') }}", {"s": "abxyz"}),
    ("str_startswith_tuple", "{{ s.startswith(('x', 'a')) }} {{ s.endswith(('q',)) }}", {"s": "abxyz"}),
    ("str_case_methods", "{{ s.upper() }}|{{ s.lower() }}|{{ s.title() }}|{{ s.capitalize() }}", {"s": "hELLO wORLD they're ß é"}),
    ("str_replace", "{{ 'aaa'.replace('a', 'b') }} {{ 'aaa'.replace('a', 'b', 2) }} {{ 'abc'.replace('', '-') }}", {}),
    ("str_find_count", "{{ 'hello'.find('l') }} {{ 'hello'.find('z') }} {{ 'hello'.count('l') }} {{ 'héé'.find('é') }}", {}),
    ("str_join", "{{ ', '.join(xs) }}|{{ ''.join(['a', 'b']) }}|{{ '-'.join('abc') }}", {"xs": ["x", "y", "z"]}),
    ("str_splitlines", "{{ s.splitlines() }}", {"s": "a\nb\r\nc\n\nd\n"}),
    ("str_method_chain", "{{ s.strip().split(' ')[0].upper() }}", {"s": "  hello world "}),
]

CONTROL = [
    ("ctl_if_elif_else_1", "{% if x == 1 %}one{% elif x == 2 %}two{% else %}other{% endif %}", {"x": 1}),
    ("ctl_if_elif_else_2", "{% if x == 1 %}one{% elif x == 2 %}two{% else %}other{% endif %}", {"x": 2}),
    ("ctl_if_elif_else_3", "{% if x == 1 %}one{% elif x == 2 %}two{% else %}other{% endif %}", {"x": 3}),
    ("ctl_if_nested", "{% if a %}A{% if b %}B{% else %}b{% endif %}{% else %}-{% endif %}", {"a": True, "b": False}),
    ("ctl_if_truthiness", "{% for v in vals %}{% if v %}T{% else %}F{% endif %}{% endfor %}",
     {"vals": [0, 1, "", "a", [], [0], {}, {"a": 1}, None, 0.0, 0.1, False, True, " "]}),
    ("ctl_for_list", "{% for x in xs %}{{ x }},{% endfor %}", {"xs": XS}),
    ("ctl_for_dict_keys", "{% for k in d %}{{ k }};{% endfor %}", {"d": {"z": 1, "a": 2, "m": 3}}),
    ("ctl_for_items_unpack", "{% for k, v in d.items() %}{{ k }}={{ v }} {% endfor %}", {"d": {"z": 1, "a": [2]}}),
    ("ctl_for_unpack_lists", "{% for a, b in [[1, 2], [3, 4]] %}{{ a }}{{ b }};{% endfor %}", {}),
    ("ctl_for_string", "{% for c in 'héj😀' %}[{{ c }}]{% endfor %}", {}),
    ("ctl_for_range", "{% for i in range(3) %}{{ i }}{% endfor %}", {}),
    ("ctl_for_range_step", "{% for i in range(1, 10, 3) %}{{ i }} {% endfor %}|{% for i in range(5, 0, -2) %}{{ i }} {% endfor %}", {}),
    ("ctl_for_else_empty", "{% for x in [] %}{{ x }}{% else %}empty{% endfor %}", {}),
    ("ctl_for_else_range0", "{% for x in range(0) %}{{ x }}{% else %}empty{% endfor %}", {}),
    ("ctl_for_else_not_taken", "{% for x in [1] %}{{ x }}{% else %}empty{% endfor %}", {}),
    ("ctl_for_undefined", "{% for x in missing %}{{ x }}{% else %}none{% endfor %}", {}),
    ("ctl_for_filter", "{% for x in xs if x > 1 %}{{ loop.index }}:{{ x }} {% endfor %}", {"xs": XS}),
    ("ctl_for_filter_length", "{% for x in xs if x is odd %}{{ loop.length }}{{ loop.last }} {% endfor %}", {"xs": XS}),
    ("ctl_for_filter_else", "{% for x in xs if x > 99 %}{{ x }}{% else %}none{% endfor %}", {"xs": XS}),
    ("ctl_loop_index", "{% for x in xs %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.revindex0 }} {% endfor %}", {"xs": ["a", "b", "c"]}),
    ("ctl_loop_first_last_length", "{% for x in xs %}{{ loop.first }}{{ loop.last }}{{ loop.length }} {% endfor %}", {"xs": ["a", "b", "c"]}),
    ("ctl_loop_single_item", "{% for x in xs %}{{ loop.first }}{{ loop.last }}{{ loop.revindex }}{% endfor %}", {"xs": ["a"]}),
    ("ctl_loop_previtem_nextitem", "{% for x in xs %}({{ loop.previtem }}<{{ x }}>{{ loop.nextitem }}){% endfor %}", {"xs": [1, 2, 3]}),
    ("ctl_loop_previtem_defined", "{% for x in xs %}{{ loop.previtem is defined }}{{ loop.nextitem is defined }} {% endfor %}", {"xs": [1, 2]}),
    ("ctl_loop_cycle", "{% for x in xs %}{{ loop.cycle('a', 'b') }}{% endfor %}|{% for x in xs %}{{ loop.cycle(1, 2, 3) }}{% endfor %}", {"xs": XS + [5]}),
    ("ctl_loop_join_commas", "{% for x in xs %}{{ x }}{% if not loop.last %}, {% endif %}{% endfor %}", {"xs": XS}),
    ("ctl_nested_outer_loop", "{% for a in [1, 2] %}{% set outer = loop %}{% for b in ['x', 'y'] %}{{ outer.index }}{{ loop.index }}{{ b }} {% endfor %}{% endfor %}", {}),
    ("ctl_nested_outer_var", "{% for row in rows %}{% set r = row.name %}{% for c in row.cells %}{{ r }}.{{ c }} {% endfor %}{% endfor %}",
     {"rows": [{"name": "a", "cells": [1, 2]}, {"name": "b", "cells": [3]}]}),
    ("ctl_break", "{% for x in xs %}{% if x == 3 %}{% break %}{% endif %}{{ x }}{% endfor %}", {"xs": XS}),
    ("ctl_continue", "{% for x in xs %}{% if x is even %}{% continue %}{% endif %}{{ x }}{% endfor %}", {"xs": XS}),
    ("ctl_break_inner_only", "{% for a in [1, 2] %}{% for b in [1, 2, 3] %}{% if b == 2 %}{% break %}{% endif %}{{ a }}{{ b }} {% endfor %}{% endfor %}", {}),
    ("ctl_continue_loop_last", "{% for x in xs %}{% if loop.last %}{% continue %}{% endif %}{{ x }}{% endfor %}", {"xs": XS}),
    ("ctl_loop_var_after_loop", "{% for i in [1, 2] %}{% endfor %}[{{ i }}]", {}),
    ("ctl_loop_var_shadows", "{% set x = 'outer' %}{% for x in [1, 2] %}{{ x }}{% endfor %}{{ x }}", {}),
    ("ctl_set_in_for_does_not_leak", "{% set x = 1 %}{% for i in [1] %}{% set x = 2 %}{{ x }}{% endfor %}{{ x }}", {}),
    ("ctl_set_in_if_leaks", "{% set x = 1 %}{% if true %}{% set x = 2 %}{% endif %}{{ x }}", {}),
    ("ctl_set_in_for_per_iteration", "{% for i in [1, 2, 3] %}[{% if i > 1 %}{{ prev }}{% endif %}]{% set prev = i %}{% endfor %}", {}),
    ("ctl_set_in_for_then_use", "{% for i in [1, 2] %}{% set y = i * 10 %}{{ y }} {% endfor %}[{{ y }}]", {}),
    ("ctl_set_overrides_context", "{% set messages = messages[1:] %}{{ messages|length }} {{ messages[0].role }}", {"messages": MSGS}),
    ("ctl_set_tuple_unpack", "{% set a, b = 1, 2 %}{{ a }}{{ b }}{% set c, d = ['x', 'y'] %}{{ c }}{{ d }}", {}),
    ("ctl_set_conditional_expr", "{% set x = 'a' if c else 'b' %}{{ x }}", {"c": False}),
    ("ctl_namespace_flag", "{% set ns = namespace(found=false) %}{% for x in xs %}{% if x == 2 %}{% set ns.found = true %}{% endif %}{% endfor %}{{ ns.found }}", {"xs": XS}),
    ("ctl_namespace_counter", "{% set ns = namespace(n=0) %}{% for x in xs %}{% set ns.n = ns.n + x %}{% endfor %}{{ ns.n }}", {"xs": XS}),
    ("ctl_namespace_kwargs", "{% set ns = namespace(a=1, b='x') %}{{ ns.a }}{{ ns.b }}[{{ ns.c }}]{{ ns.c is defined }}", {}),
    ("ctl_namespace_new_attr", "{% set ns = namespace() %}{% set ns.x = 'new' %}{{ ns.x }}", {}),
    ("ctl_namespace_nested_loops", "{% set ns = namespace(s='') %}{% for a in [1, 2] %}{% for b in ['x', 'y'] %}{% set ns.s = ns.s ~ a ~ b %}{% endfor %}{% endfor %}{{ ns.s }}", {}),
    ("ctl_namespace_last_index", "{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m.role == 'user' %}{% set ns.last = loop.index0 %}{% endif %}{% endfor %}{{ ns.last }}", {"messages": MSGS}),
    ("ctl_namespace_from_dict", "{% set ns = namespace({'a': 1}, b=2) %}{{ ns.a }}{{ ns.b }}", {}),
    ("ctl_namespace_repr", "{% set ns = namespace(a=1, b='x') %}{{ ns }}", {}),
    ("ctl_block_set", "{% set x %}a{{ 1 + 1 }}b{% endset %}[{{ x }}]", {}),
    ("ctl_block_set_whitespace", "{% set x %}\n  hi\n{% endset %}[{{ x }}]", {}),
    ("ctl_block_set_filter", "{% set x | upper %}abc{{ 'd' }}{% endset %}{{ x }}", {}),
    ("ctl_macro_positional", "{% macro m(a, b) %}[{{ a }}|{{ b }}]{% endmacro %}{{ m(1, 2) }}{{ m('x', 'y') }}", {}),
    ("ctl_macro_defaults_keywords", "{% macro m(a, b='d') %}[{{ a }}|{{ b }}]{% endmacro %}{{ m(1) }}{{ m(1, 2) }}{{ m(b=3, a=4) }}{{ m(5, b=6) }}", {}),
    ("ctl_macro_missing_arg", "{% macro m(a, b) %}[{{ a }}|{{ b }}|{{ b is defined }}]{% endmacro %}{{ m(1) }}", {}),
    ("ctl_macro_reads_global", "{% macro m() %}<{{ name }}>{% endmacro %}{{ m() }}{{ m() }}", {"name": "N"}),
    ("ctl_macro_reads_later_set", "{% macro m() %}{{ y }}{% endmacro %}{% set y = 5 %}{{ m() }}", {}),
    ("ctl_macro_in_expression", "{% macro m(x) %}<{{ x }}>{% endmacro %}{{ m(1) ~ '!' }} {{ m('a')|length }}", {}),
    ("ctl_macro_in_loop", "{% macro item(x, i) %}{{ i }}={{ x }}{% endmacro %}{% for x in xs %}{{ item(x, loop.index) }} {% endfor %}", {"xs": ["a", "b"]}),
    ("ctl_macro_multiline", "{% macro m(x) %}\n  <{{ x }}>\n{% endmacro %}\n{{ m(1) }}{{ m(2) }}", {}),
    ("ctl_macro_minus", "{%- macro m(x) -%}\n  <{{ x }}>\n{%- endmacro -%}\n{{ m(1) }}{{ m(2) }}", {}),
    ("ctl_comment", "a{# {{ x }} {% if %} #}b", {}),
    ("ctl_chat_loop", "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}", {"messages": MSGS}),
    ("ctl_system_extract", "{% if messages[0]['role'] == 'system' %}{% set sys = messages[0]['content'] %}{% set rest = messages[1:] %}"
     "{% else %}{% set sys = '' %}{% set rest = messages %}{% endif %}<{{ sys }}>{% for m in rest %}{{ m.role[0] }}{% endfor %}", {"messages": MSGS}),
    ("ctl_alternation_check", "{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}!{% else %}.{% endif %}{% endfor %}",
     {"messages": MSGS[1:] + [MSGS[1]]}),
    ("ctl_reverse_index", "{% for m in messages[::-1] %}{% set i = (messages|length - 1) - loop.index0 %}{{ i }}{{ m.role[0] }} {% endfor %}", {"messages": MSGS}),
]

FILTERS = [
    ("flt_trim", "[{{ s|trim }}]", {"s": " \n\t a b \u3000\n"}),
    ("flt_trim_chars", "[{{ 'xxaxx'|trim('x') }}][{{ '--a-'|trim('-') }}]", {}),
    ("flt_length", "{{ 'héllo'|length }} {{ xs|length }} {{ d|length }} {{ ''|length }} {{ missing|length }}", {"xs": XS, "d": D}),
    ("flt_count", "{{ 'abc'|count }} {{ xs|count }}", {"xs": XS}),
    ("flt_lower_upper", "{{ s|lower }} {{ s|upper }}", {"s": "HéLLo ß"}),
    ("flt_title", "{{ s|title }}", {"s": "hello wORLD they're o'neil a-b x_y"}),
    ("flt_capitalize", "{{ s|capitalize }}", {"s": "hELLO wORLD"}),
    ("flt_tojson_dict_order", "{{ d|tojson }}", {"d": {"z": 1, "a": 2, "m": {"y": None, "b": True}}}),
    ("flt_tojson_nested", "{{ d|tojson }}", {"d": {"a": [1, [2, {"b": []}]], "c": {}}}),
    ("flt_tojson_unicode", "{{ s|tojson }}", {"s": "é日本😀\u2028\u00a0"}),
    ("flt_tojson_escapes", "{{ s|tojson }}", {"s": "q\"b\\s/n\nt\tr\rc\x01\x1f\x7f</script>&'"}),
    ("flt_tojson_scalars", "{{ none|tojson }} {{ true|tojson }} {{ false|tojson }} {{ 1|tojson }} {{ -2|tojson }} {{ 'x'|tojson }}", {}),
    ("flt_tojson_floats", "{{ xs|tojson }}", {"xs": [1.0, 0.1, 1e20, 1e-7, 2.5e-05, 123456789012345678.0, -0.0, 1e16, 1e15, 0.30000000000000004]}),
    ("flt_tojson_indent2", "{{ d|tojson(indent=2) }}", {"d": {"a": [1, {"b": None}], "c": {}, "e": [], "f": "x"}}),
    ("flt_tojson_indent4", "{{ d|tojson(indent=4) }}", {"d": {"name": "f", "parameters": {"type": "object", "required": ["x"]}}}),
    ("flt_tojson_indent_scalar", "{{ 1|tojson(indent=2) }} {{ []|tojson(indent=2) }} {{ {}|tojson(indent=2) }}", {}),
    ("flt_tojson_separators", "{{ d|tojson(separators=(',', ':')) }}", {"d": {"a": [1, 2], "b": "x y"}}),
    ("flt_tojson_indent_separators", "{{ d|tojson(indent=1, separators=(',', ': ')) }}", {"d": {"a": [1, 2]}}),
    ("flt_tojson_sort_keys", "{{ d|tojson(sort_keys=true) }}", {"d": {"z": 1, "a": {"y": 2, "b": 3}, "B": 0}}),
    ("flt_tojson_tuple_and_literal_int_key", "{{ (1, 'a')|tojson }} {{ {1: 'a'}|tojson }}", {}),
    ("flt_tojson_in_string", "{{ '{\"args\": ' ~ d|tojson ~ '}' }}", {"d": {"city": "Paris"}}),
    ("flt_string", "{{ 1|string }} {{ [1, 'a']|string }} {{ none|string }} {{ 1.5|string ~ 'x' }}", {}),
    ("flt_int", "{{ '12'|int }} {{ '1.9'|int }} {{ 3.9|int }} {{ -3.9|int }} {{ 'x'|int }} {{ 'x'|int(5) }} {{ 'x'|int(default=7) }}", {}),
    ("flt_int_more", "{{ ' 12 '|int }} {{ true|int }} {{ none|int }} {{ '0x1A'|int(0, 16) }} {{ '1e3'|int }}", {}),
    ("flt_int_bad_base", "{{ 'z'|int(base=99) }} {{ '12'|int(base=99) }}", {}),
    ("flt_float", "{{ '1.5'|float }} {{ 'x'|float }} {{ 2|float }} {{ '1e3'|float }} {{ 'x'|float(1.5) }}", {}),
    ("flt_list", "{{ 'abc'|list }} {{ d|list }} {{ xs|list }}", {"d": {"b": 1, "a": 2}, "xs": [1]}),
    ("flt_join", "{{ xs|join }}|{{ xs|join(', ') }}|{{ 'abc'|join('-') }}", {"xs": [1, "a", None]}),
    ("flt_join_attribute", "{{ people|join(', ', attribute='name') }}", {"people": PEOPLE}),
    ("flt_first_last", "{{ xs|first }} {{ xs|last }} {{ 'héj'|first }} {{ 'héj'|last }} [{{ []|first }}]", {"xs": XS}),
    ("flt_default", "{{ missing|default('x') }} [{{ ''|default('x') }}] {{ ''|default('x', true) }} {{ none|default('x') }} {{ 0|default('x', boolean=true) }}", {}),
    ("flt_default_alias_d", "{{ missing|d('y') }} {{ v|d('y', true) }} {{ d.nope|d('z') }}", {"v": [], "d": D}),
    ("flt_default_defined", "{{ v|default('x') }}", {"v": False}),
    ("flt_replace", "{{ 'aaa'|replace('a', 'b') }} {{ 'aaa'|replace('a', 'b', 2) }} {{ s|replace('\\n', ' ') }}", {"s": "a\nb\nc"}),
    ("flt_selectattr_equalto", "{{ messages|selectattr('role', 'equalto', 'user')|map(attribute='content')|list }}", {"messages": MSGS}),
    ("flt_selectattr_eq_length", "{{ messages|selectattr('role', 'eq', 'user')|list|length }}", {"messages": MSGS}),
    ("flt_rejectattr", "{{ messages|rejectattr('role', 'equalto', 'system')|map(attribute='role')|join(',') }}", {"messages": MSGS}),
    ("flt_selectattr_defined", "{{ msgs|selectattr('content', 'defined')|list|length }} {{ msgs|rejectattr('content', 'defined')|list|length }}",
     {"msgs": [{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": []}]}),
    ("flt_selectattr_truthy", "{{ msgs|selectattr('tool_calls')|list|length }}",
     {"msgs": [{"role": "assistant", "tool_calls": [{"id": 1}]}, {"role": "assistant", "tool_calls": []}, {"role": "user"}]}),
    ("flt_select_reject", "{{ xs|select('odd')|list }} {{ xs|reject('odd')|list }} {{ vals|select|list }}", {"xs": XS, "vals": [0, 1, "", "a", None]}),
    ("flt_map_attribute", "{{ messages|map(attribute='role')|list }}", {"messages": MSGS}),
    ("flt_map_attribute_default", "{{ msgs|map(attribute='content', default='?')|list }}", {"msgs": [{"content": "a"}, {}]}),
    ("flt_map_filter", "{{ ['a', 'b']|map('upper')|list }} {{ ['1', '2']|map('int')|sum }}", {}),
    ("flt_items", "{% for k, v in d|items %}{{ k }}={{ v }} {% endfor %}{{ d|items|list }}", {"d": {"b": 1, "a": 2}}),
    ("flt_safe", "{{ '<b>&</b>'|safe }} {{ '<i>' }}", {}),
    ("flt_reverse", "{{ xs|reverse|list }} {{ 'abc'|reverse }} {{ 'héj'|reverse }}", {"xs": XS}),
    ("flt_sort", "{{ xs|sort }} {{ xs|sort(reverse=true) }}", {"xs": [3, 1, 2]}),
    ("flt_sort_strings_case", "{{ xs|sort }} {{ xs|sort(case_sensitive=true) }}", {"xs": ["b", "A", "c", "B"]}),
    ("flt_sort_attribute", "{{ people|sort(attribute='age')|map(attribute='name')|join(',') }} {{ people|sort(attribute='name')|map(attribute='name')|join(',') }}", {"people": PEOPLE}),
    ("flt_unique", "{{ xs|unique|list }} {{ ['a', 'A', 'b']|unique|list }}", {"xs": [1, 2, 1, 3, 2]}),
    ("flt_indent", "{{ s|indent(2) }}|{{ s|indent(2, true) }}|{{ s|indent }}", {"s": "a\nb\n\nc"}),
    ("flt_indent_first_blank", "{{ s|indent(2, first=true, blank=true) }}|{{ s|indent('> ') }}", {"s": "a\n\nb\n"}),
    ("flt_abs", "{{ (-3)|abs }} {{ x|abs }} {{ 2|abs }}", {"x": -3.5}),
    ("flt_round", "{{ 2.5|round }} {{ 3.5|round }} {{ 1.2345|round(2) }} {{ 2.675|round(2) }} {{ 2|round }} {{ -1.5|round }}", {}),
    ("flt_round_methods", "{{ 1.55|round(1, 'floor') }} {{ 1.51|round(1, 'ceil') }} {{ 1.5|round(0, 'floor') }} {{ -1.5|round(method='ceil') }}", {}),
    ("flt_min_max", "{{ xs|min }} {{ xs|max }} {{ ['b', 'A', 'c']|max }} {{ ['b', 'A', 'c']|min }}", {"xs": [3, 1, 2]}),
    ("flt_max_attribute", "{{ (people|max(attribute='age')).name }}", {"people": PEOPLE}),
    ("flt_sum", "{{ xs|sum }} {{ [0.1, 0.2]|sum }} {{ people|sum(attribute='age') }} {{ xs|sum(start=10) }} {{ []|sum }}", {"xs": XS, "people": PEOPLE}),
    ("flt_wordcount", "{{ 'hello big  world'|wordcount }} {{ ''|wordcount }} {{ \"it's a-b\"|wordcount }}", {}),
    ("flt_dictsort", "{{ d|dictsort }}", {"d": {"b": 1, "a": 2, "C": 3}}),
    ("flt_chain", "{{ messages|map(attribute='content')|join('\\n')|upper }}", {"messages": MSGS}),
    ("flt_length_of_filtered", "{{ messages|selectattr('role', 'equalto', 'user')|list|length is even }}", {"messages": MSGS}),
]

TESTS = [
    ("tst_defined", "{{ x is defined }} {{ missing is defined }} {{ x is undefined }} {{ missing is undefined }}", {"x": None}),
    ("tst_none", "{{ x is none }} {{ 0 is none }} {{ missing is none }}", {"x": None}),
    ("tst_string", "{{ 'a' is string }} {{ 1 is string }} {{ missing is string }} {{ ['a'] is string }}", {}),
    ("tst_number", "{{ 1 is number }} {{ 1.5 is number }} {{ '1' is number }} {{ true is number }}", {}),
    ("tst_integer_float", "{{ 1 is integer }} {{ 1.0 is integer }} {{ true is integer }} {{ 1.0 is float }} {{ 1 is float }}", {}),
    ("tst_boolean", "{{ true is boolean }} {{ 1 is boolean }} {{ none is boolean }}", {}),
    ("tst_true_false", "{{ true is true }} {{ 1 is true }} {{ false is false }} {{ 0 is false }} {{ none is false }}", {}),
    ("tst_mapping", "{{ d is mapping }} {{ xs is mapping }} {{ 'a' is mapping }}", {"d": {}, "xs": []}),
    ("tst_iterable", "{{ xs is iterable }} {{ 'a' is iterable }} {{ d is iterable }} {{ 1 is iterable }} {{ none is iterable }} {{ missing is iterable }}", {"xs": [], "d": {}}),
    ("tst_sequence", "{{ xs is sequence }} {{ 'a' is sequence }} {{ d is sequence }} {{ 1 is sequence }}", {"xs": [], "d": {}}),
    ("tst_callable", "{{ range is callable }} {{ 'a' is callable }} {{ raise_exception is callable }} {{ missing is callable }}", {}),
    ("tst_equalto", "{{ 1 is equalto 1 }} {{ 1 is eq 1.0 }} {{ 'a' is equalto('b') }}", {}),
    ("tst_ne_lt_gt", "{{ 1 is ne 2 }} {{ 1 is lt 2 }} {{ 1 is gt 2 }} {{ 2 is le 2 }} {{ 2 is ge 3 }}", {}),
    ("tst_in", "{{ 'a' is in ['a', 'b'] }} {{ 'z' is in 'abc' }} {{ 'k' is in {'k': 1} }}", {}),
    ("tst_odd_even", "{{ 3 is odd }} {{ 3 is even }} {{ 0 is even }} {{ -1 is odd }}", {}),
    ("tst_divisibleby", "{{ 6 is divisibleby(3) }} {{ 7 is divisibleby(3) }}", {}),
    ("tst_divisibleby_bare", "{{ 6 is divisibleby 3 }} {{ 4 is divisibleby 3 }}", {}),
    ("tst_sameas", "{{ none is sameas none }} {{ x is sameas false }} {{ f is sameas false }}", {"x": 0, "f": False}),
    ("tst_lower_upper", "{{ 'abc' is lower }} {{ 'aBc' is lower }} {{ 'ABC' is upper }} {{ 'AB1' is upper }} {{ '1' is lower }}", {}),
    ("tst_is_not", "{{ x is not defined }} {{ 1 is not string }} {{ none is not none }} {{ 2 is not divisibleby 2 }}", {"x": 1}),
    ("tst_not_is", "{{ not x is defined }} {{ not missing is defined }}", {"x": 1}),
    ("tst_in_if", "{% if m.content is defined and m.content is string %}s{% endif %}{% if m.tool_calls is not defined %}n{% endif %}", {"m": MSGS[1]}),
    ("tst_filter_then_test", "{{ xs|length is even }} {{ 'abc'|upper is upper }}", {"xs": XS}),
]

GLOBALS = [
    ("gl_range", "{{ range(3)|list }} {{ range(1, 7, 2)|list }} {{ range(3, 0, -1)|list }} {{ range(0)|list }} {{ range(-2)|list }}", {}),
    ("gl_range_repr", "{{ range(3) }} {{ range(1, 5, 2) }}", {}),
    ("gl_range_length", "{{ range(5)|length }} {{ range(10)[2] }} {{ range(10)[-1] }}", {}),
    ("gl_dict", "{{ dict(a=1, b='x') }} {{ dict(a=1)|tojson }} {{ dict() }}", {}),
    ("gl_namespace_global", "{% set ns = namespace(v=1) %}{% set ns.v = ns.v + 1 %}{{ ns.v }}", {}),
    ("gl_bos_eos", "{{ bos_token }}x{{ eos_token }}", {"bos_token": "<s>", "eos_token": "</s>"}),
    ("gl_add_generation_prompt_true", "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}",
     {"messages": MSGS[1:2], "add_generation_prompt": True}),
    ("gl_add_generation_prompt_false", "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}",
     {"messages": MSGS[1:3], "add_generation_prompt": False}),
    ("gl_add_generation_prompt_missing", "[{% if add_generation_prompt %}gen{% endif %}]", {}),
    ("gl_full_chat", "{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] | trim + eos_token + '\\n' }}{% endfor %}"
     "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}",
     {"messages": [{"role": "user", "content": " Hi \n"}, {"role": "assistant", "content": "Yo"}], "bos_token": "<s>", "eos_token": "</s>",
      "add_generation_prompt": True}),
    ("gl_raise_not_reached", "{% if false %}{{ raise_exception('never') }}{% endif %}ok", {}),
    ("gl_raise_exception", "a{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}", {}),
    ("gl_raise_in_loop", "{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}{{ m.role }}{% endfor %}",
     {"messages": MSGS}),
]

ERRORS = [
    ("err_undefined_attr", "{{ x.y }}", {}),
    ("err_undefined_item", "{{ x['y'] }}", {}),
    ("err_missing_key_attr", "{{ d.nope.x }}", {"d": D}),
    ("err_missing_key_attr_in_test", "{{ d.nope.x is defined }}", {"d": D}),
    ("err_undefined_in_if_attr", "{% if missing.x %}y{% endif %}", {}),
    ("err_undefined_add", "{{ missing + 1 }}", {}),
    ("err_undefined_call", "{{ missing() }}", {}),
    ("err_str_add_undefined", "{{ 'a' + missing }}", {}),
    ("err_unknown_filter", "{{ x|nofilter }}", {}),
    ("err_unknown_filter_untaken_branch", "{% if false %}{{ x|nofilter }}{% endif %}", {}),
    ("err_unknown_test", "{{ x is notatest }}", {}),
    ("err_unclosed_if", "{% if true %}x", {}),
    ("err_unclosed_for", "{% for x in xs %}x", {}),
    ("err_mismatched_end", "{% for x in xs %}{% endif %}", {}),
    ("err_unclosed_expr", "{{ 1 + }}", {}),
    ("err_unclosed_comment", "a{# b", {}),
    ("err_unknown_tag", "{% frobnicate %}", {}),
    ("err_int_division_by_zero", "{{ 1 // 0 }}", {}),
    ("err_division_by_zero", "{{ 1 / 0 }}", {}),
    ("err_modulo_by_zero", "{{ 1 % 0 }}", {}),
    ("err_int_plus_str", "{{ 1 + 'a' }}", {}),
    ("err_str_plus_int", "{{ 'a' + 1 }}", {}),
    ("err_tilde_then_add", "{{ 'a' ~ 1 + 2 }}", {}),
    ("err_list_plus_str", "{{ [1] + 'a' }}", {}),
    ("err_compare_str_int", "{{ 'a' < 1 }}", {}),
    ("err_raise_exception", "{{ raise_exception('Only user and assistant roles are supported!') }}", {}),
    ("err_list_append_unsafe", "{% set xs = [] %}{{ xs.append(1) }}", {}),
    ("err_namespace_underscore", "{% set ns = namespace() %}{% set ns._x = 1 %}", {}),
    ("err_tojson_undefined", "{{ missing|tojson }}", {}),
    ("err_set_attr_non_namespace", "{% set d = {} %}{% set d.x = 1 %}", {}),
]

GROUPS = [("whitespace", WHITESPACE), ("values", VALUES), ("literals", LITERALS), ("operators", OPERATORS),
          ("subscript", SUBSCRIPT), ("methods", METHODS), ("control", CONTROL), ("filters", FILTERS), ("tests", TESTS),
          ("globals", GLOBALS), ("errors", ERRORS)]


def render_case(template: str, context: dict) -> dict:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escape sequences in string literals warn
            return {"output": _compile_jinja_template(template).render(**context)}
    except Exception as e:  # noqa: BLE001 - the message is the oracle
        return {"error": str(e), "error_type": type(e).__name__}


def jinja_cases() -> dict:
    cases, names = [], set()
    for group, items in GROUPS:
        for name, template, context in items:
            assert name not in names, name
            names.add(name)
            context = json.loads(json.dumps(context))  # exactly what a JSON reader sees
            case = {"name": name, "group": group, "template": template, "context": context}
            case.update(render_case(template, context))
            assert "0x" not in case.get("output", ""), (name, case)  # no object addresses
            cases.append(case)
    return {"generated_by": GENERATED_BY, "cases": cases}


# --------------------------------------------------------------------------------------------
# Chat templates (written here in the style of each family)
# --------------------------------------------------------------------------------------------

LLAMA3 = r"""{%- for message in messages %}
    {%- set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' %}
    {%- if loop.index0 == 0 %}
        {%- set content = bos_token + content %}
    {%- endif %}
    {{- content }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

LLAMA31_TOOLS = r"""{{- bos_token }}
{%- if date_string is not defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- set ns = namespace(system="", turns=messages, tools=none) %}
{%- if tools is defined and tools is not none and tools | length > 0 %}
    {%- set ns.tools = tools %}
{%- endif %}

{#- Pull the system message out of the conversation #}
{%- if messages[0]['role'] == 'system' %}
    {%- set ns.system = messages[0]['content'] | trim %}
    {%- set ns.turns = messages[1:] %}
{%- endif %}

{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if ns.tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " ~ date_string ~ "\n\n" }}
{{- ns.system }}
{{- "<|eot_id|>" }}

{#- Tool definitions go at the top of the first user turn #}
{%- if ns.tools is not none %}
    {%- if ns.turns | length == 0 %}
        {{- raise_exception("Tools need a first user message to go into, and there is none.") }}
    {%- endif %}
    {%- set first_user = ns.turns[0]['content'] | trim %}
    {%- set ns.turns = ns.turns[1:] %}
    {{- "<|start_header_id|>user<|end_header_id|>\n\n" }}
    {{- "You can call the functions listed below. To call one, reply with a JSON object of the form " }}
    {{- '{"name": function name, "parameters": {argument name: value}}' }}
    {{- " and nothing else.\n\n" }}
    {%- for tool in ns.tools %}
        {{- tool | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user ~ "<|eot_id|>" }}
{%- endif %}

{%- for message in ns.turns %}
    {%- if message.role in ["ipython", "tool"] %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is string %}
            {{- message.content }}
        {%- else %}
            {{- message.content | tojson }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- elif message.tool_calls is defined %}
        {%- if message.tool_calls | length != 1 %}
            {{- raise_exception("Only one tool call per assistant turn is supported.") }}
        {%- endif %}
        {%- set call = message.tool_calls[0].function %}
        {{- "<|start_header_id|>assistant<|end_header_id|>\n\n" }}
        {{- '{"name": "' ~ call.name ~ '", "parameters": ' ~ call.arguments | tojson ~ "}" }}
        {{- "<|eot_id|>" }}
    {%- else %}
        {{- "<|start_header_id|>" ~ message.role ~ "<|end_header_id|>\n\n" ~ message.content | trim ~ "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- "<|start_header_id|>assistant<|end_header_id|>\n\n" }}
{%- endif %}
"""

CHATML = r"""{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"""

CHATML_QWEN25 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more of these functions to help with the request. Their signatures are inside <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nTo call a function, put a JSON object with its name and arguments inside <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

QWEN3_THINK = r"""{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{#- Find the last real user query: thinking is kept only after it #}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and not (message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning = '' %}
        {%- if '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning) %}
            {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or messages[loop.index0 - 1].role != "tool" %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != "tool" %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- elif not (message.role == "system" and loop.first) %}
        {{- raise_exception('Unexpected message role: ' ~ message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""

MISTRAL = r"""{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('After an optional system message, roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system_message is defined %}
            {{- '[INST] ' + system_message + '\n\n' + message['content'] + '[/INST]' }}
        {%- else %}
            {{- '[INST] ' + message['content'] + '[/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token }}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported, after an optional system message.') }}
    {%- endif %}
{%- endfor %}
"""

LLAMA2 = r"""{%- if messages[0]['role'] == 'system' -%}
    {%- set loop_messages = messages[1:] -%}
    {%- set system_message = messages[0]['content'] -%}
{%- else -%}
    {%- set loop_messages = messages -%}
    {%- set system_message = false -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') -}}
    {%- endif -%}
    {%- if loop.index0 == 0 and system_message != false -%}
        {%- set content = '<<SYS>>\n' + system_message + '\n<</SYS>>\n\n' + message['content'] -%}
    {%- else -%}
        {%- set content = message['content'] -%}
    {%- endif -%}
    {%- if message['role'] == 'user' -%}
        {{- bos_token + '[INST] ' + content | trim + ' [/INST]' -}}
    {%- elif message['role'] == 'assistant' -%}
        {{- ' ' + content | trim + ' ' + eos_token -}}
    {%- endif -%}
{%- endfor -%}
"""

GEMMA = r"""{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'assistant' %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"""

PHI3 = r"""{% for message in messages %}
    {% if message['role'] == 'system' %}
{{ '<|system|>\n' + message['content'] + '<|end|>' }}
    {% elif message['role'] == 'user' %}
{{ '<|user|>\n' + message['content'] + '<|end|>' }}
    {% elif message['role'] == 'assistant' %}
{{ '<|assistant|>\n' + message['content'] + '<|end|>' }}
    {% else %}
{{ raise_exception('Unknown role: ' + message['role']) }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
{{ '<|assistant|>' }}
{% else %}
{{ eos_token -}}
{% endif %}
"""

SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|im_start|>",
           "<|im_end|>", "<|endoftext|>", "<s>", "</s>", "[INST]", "[/INST]", "<start_of_turn>", "<end_of_turn>", "<bos>",
           "<eos>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]

# --------------------------------------------------------------------------------------------
# Conversations
# --------------------------------------------------------------------------------------------

U1 = {"role": "user", "content": "What is the capital of France?"}
A1 = {"role": "assistant", "content": "The capital of France is Paris."}
U2 = {"role": "user", "content": "And of Germany?"}
A2 = {"role": "assistant", "content": "Berlin."}
SYS = {"role": "system", "content": "You are a concise assistant. Answer in one sentence."}
U_UNI = {"role": "user", "content": "Ça va ? Réponds en 日本語, s'il te plaît 😀"}
A_UNI = {"role": "assistant", "content": "はい、元気です！ Merci — «très bien»."}
U_WS = {"role": "user", "content": "  \n  padded question?\t\n\n"}
A_WS = {"role": "assistant", "content": "\n first line\n\n  second line  \n"}
U_ML = {"role": "user", "content": "Write a list:\n- apples\n- pears\n\nThanks."}

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name, e.g. Paris"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a time zone (IANA name, like \"Europe/Zürich\").",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}
U_WEATHER = {"role": "user", "content": "What's the weather in Paris right now?"}
CALL_WEATHER = {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                                                       "arguments": {"city": "Paris", "unit": "celsius"}}}]}
A_WEATHER = {"role": "assistant", "content": "It is 21.5 °C and sunny in Paris."}


def conv(name, messages, agp, tools=None, extra=None):
    c = {"name": name, "messages": messages}
    if tools is not None:
        c["tools"] = tools
    if extra is not None:
        c["extra"] = extra
    c["add_generation_prompt"] = agp
    return c


TEMPLATES = {
    "llama3": (LLAMA3, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}, [
        conv("single_gen", [U1], True),
        conv("single_answered", [U1, A1], False),
        conv("multi_turn", [U1, A1, U2, A2], False),
        conv("system_gen", [SYS, U1, A1, U2], True),
        conv("non_ascii", [U_UNI, A_UNI], False),
        conv("whitespace", [U_WS, A_WS, U_ML], True),
        conv("error_missing_role", [U1, {"content": "no role here"}], False),
    ]),
    "llama31_tools": (LLAMA31_TOOLS, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}, [
        conv("no_tools_gen", [U1], True),
        conv("system_no_tools", [SYS, U1, A1], False),
        conv("date_string_given", [SYS, U1], True, extra={"date_string": "01 Jan 2025"}),
        conv("tools_gen", [SYS, U_WEATHER], True, tools=[WEATHER_TOOL, TIME_TOOL]),
        conv("tool_call_round_trip", [U_WEATHER, CALL_WEATHER,
                                      {"role": "tool", "content": "{\"temperature\": 21.5, \"condition\": \"sunny\"}"}, A_WEATHER],
             False, tools=[WEATHER_TOOL]),
        conv("ipython_dict_content", [U_WEATHER, CALL_WEATHER, {"role": "ipython", "content": {"temperature": 21.5, "unit": "°C"}}],
             True, tools=[WEATHER_TOOL]),
        conv("error_tools_without_user", [SYS], True, tools=[WEATHER_TOOL]),
        conv("error_two_tool_calls", [U_WEATHER, {"role": "assistant", "tool_calls": CALL_WEATHER["tool_calls"] * 2}], False,
             tools=[WEATHER_TOOL]),
    ]),
    "chatml": (CHATML, {"eos_token": "<|im_end|>"}, [
        conv("single_gen", [U1], True),
        conv("system_multi", [SYS, U1, A1, U2, A2], False),
        conv("non_ascii", [U_UNI, A_UNI], False),
        conv("whitespace_kept", [U_WS, A_WS], False),
        conv("error_missing_content", [{"role": "user"}], True),
    ]),
    "chatml_qwen25": (CHATML_QWEN25, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, [
        conv("default_system_gen", [U1], True),
        conv("system_multi", [SYS, U1, A1, U2, A2], False),
        conv("non_ascii_whitespace", [U_UNI, A_UNI, U_WS, A_WS], False),
        conv("tools_gen", [U_WEATHER], True, tools=[WEATHER_TOOL, TIME_TOOL]),
        conv("tools_with_system", [SYS, U_WEATHER], True, tools=[WEATHER_TOOL]),
        conv("tool_calls_grouped_responses", [
            {"role": "user", "content": "Weather in Paris and the time in Zürich?"},
            {"role": "assistant", "content": "Let me check both.", "tool_calls": [
                CALL_WEATHER["tool_calls"][0],
                {"type": "function", "function": {"name": "get_time", "arguments": "{\"tz\": \"Europe/Zurich\"}"}}]},
            {"role": "tool", "content": "{\"temperature\": 21.5}"},
            {"role": "tool", "content": "14:05"},
            {"role": "assistant", "content": "21.5 °C in Paris; it is 14:05 in Zürich."}], False, tools=[WEATHER_TOOL, TIME_TOOL]),
        conv("tool_call_no_content_gen", [U_WEATHER, CALL_WEATHER, {"role": "tool", "content": "sunny"}], True, tools=[WEATHER_TOOL]),
        conv("error_missing_content", [U1, {"role": "assistant"}], False),
    ]),
    "qwen3_think": (QWEN3_THINK, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, [
        conv("single_gen", [U1], True),
        conv("thinking_disabled_gen", [U1], True, extra={"enable_thinking": False}),
        conv("thinking_enabled_gen", [SYS, U1], True, extra={"enable_thinking": True}),
        conv("think_history", [
            U1, {"role": "assistant", "content": "<think>\nThe user asks about France.\n</think>\n\nParis."},
            U2, {"role": "assistant", "content": "<think>\nGermany's capital.\n</think>\n\nBerlin."}], False),
        conv("final_without_think", [SYS, U1, A1], False),
        conv("think_then_gen", [U_UNI, {"role": "assistant", "content": "<think>\n日本語で。\n</think>\n\nはい！"}, U_ML], True,
             extra={"enable_thinking": False}),
        conv("tool_turns", [
            U_WEATHER, {"role": "assistant", "content": "<think>\nNeed the tool.\n</think>\n\nChecking."},
            {"role": "tool", "content": "sunny, 21.5"},
            {"role": "assistant", "content": "<think>\nGot it.\n</think>\n\nSunny, 21.5 °C."}], False),
        conv("error_unknown_role", [U1, {"role": "narrator", "content": "Meanwhile..."}], False),
    ]),
    "mistral": (MISTRAL, {"bos_token": "<s>", "eos_token": "</s>"}, [
        conv("single", [U1], False),
        conv("multi_turn", [U1, A1, U2, A2], False),
        conv("system", [SYS, U1, A1, U2], False),
        conv("non_ascii_whitespace", [U_UNI, A_UNI, U_WS], True),
        conv("error_not_alternating", [U1, U2], False),
        conv("error_assistant_first", [A1, U1], False),
    ]),
    "llama2": (LLAMA2, {"bos_token": "<s>", "eos_token": "</s>"}, [
        conv("single", [U1], False),
        conv("system_multi", [SYS, U1, A1, U2], False),
        conv("whitespace_trimmed", [U_WS, A_WS, U_ML, A2], False),
        conv("non_ascii", [U_UNI, A_UNI], False),
        conv("error_not_alternating", [SYS, U1, A1, A2], False),
    ]),
    "gemma": (GEMMA, {"bos_token": "<bos>", "eos_token": "<eos>"}, [
        conv("single_gen", [U1], True),
        conv("multi_turn", [U1, A1, U2, A2], False),
        conv("multi_turn_gen", [U1, A1, U2], True),
        conv("non_ascii_whitespace", [U_UNI, A_UNI, U_WS, A_WS], False),
        conv("error_system_role", [SYS, U1], True),
        conv("error_not_alternating", [U1, U2], True),
    ]),
    "phi3": (PHI3, {"bos_token": "<s>", "eos_token": "<|endoftext|>"}, [
        conv("single_gen", [U1], True),
        conv("system_answered", [SYS, U1, A1], False),
        conv("multi_turn", [U1, A1, U2, A2], False),
        conv("non_ascii_whitespace", [U_UNI, A_UNI, U_WS], True),
        conv("error_unknown_role", [U1, {"role": "tool", "content": "x"}], False),
    ]),
}

# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
VOCAB_SIZE = 1500

SUBJECTS = ["the model", "a user", "the assistant", "my friend", "the weather", "this city", "the system", "our team",
            "the capital", "a question", "the answer", "every function", "the tool", "the teacher", "a small dog"]
VERBS = ["is", "was", "will be", "seems", "looks", "answers", "calls", "returns", "asks about", "writes", "reads", "knows"]
OBJECTS = ["sunny and warm", "in Paris", "very helpful", "the current time", "a short list", "one sentence", "the result",
           "Berlin", "a JSON object", "the first message", "an apple and a pear", "twenty one degrees", "the tools"]
TAILS = [".", "!", "?", ", thanks.", " today.", " right now.", "\n", ":\n- one\n- two\n"]
WORDS = """about above across after again against air almost alone along already also always among animal another
answer any anything apple area around ask away back bad base be beautiful because become bed been before began begin
behind being below best better between big bird black blue boat body book both bottom box boy bread bring brother brown
build built busy but buy call came can car care carry case cat cause center certain change check child children city
class clear close cloud cold color come common complete contain correct could country course cover cross cry cut dark
day deep did different direction do does dog done door down draw dream drink drive dry during each early earth east
eat edge egg eight either else end enough even evening ever every example eye face fact fall family far farm fast
father feel feet few field fight figure fill final find fine fire first fish five floor flower fly follow food foot
for force forest form forward found four free friend from front full game garden gave get girl give glass go gold
good got great green ground group grow had half hand happen happy hard has have he head hear heard heart heat heavy
help her here high hill him his hold hole home hope horse hot hour house how however hundred idea if important inch
inside instead interest into island it its just keep kind king knew know land language large last late laugh lay
learn leave left less let letter life light like line list listen little live long look lost love low machine made
main make man many map mark may mean measure meet men might mile mind minute miss money month moon more morning most
mother mountain move much music must name near need never new next night nothing notice now number object ocean off
offer office often oil old once only open order other our out over own page paper part pass past pattern people
perhaps person picture piece place plain plan plant play point poor position possible power present pretty problem
produce product pull put question quick quiet rain ran reach read ready real reason record red remember rest river
road rock room round rule run said same sat saw say school science sea season second see seem sell send sentence
serve set several shape share ship short should show side sign simple since sing sister sit six size sky sleep slow
small snow so soft soil some something song soon sound south space speak special spell spring stand star start state
stay step still stone stood stop store story street strong student study such summer sun sure surface table take talk
teach tell ten test than that their them then there these they thing think third those though thought three through
time together told too took top toward town travel tree true try turn twelve two under until upon usual valley very
voice walk wall want warm was watch water wave way weather week weight well went were west what wheel when where
which while white whole why wide wild will wind window winter wish with without woman wonder wood word work world
would write wrong year yellow yes yet you young""".split()

EXTRA_TEXT = [
    "Ça va ? Très bien, merci. Réponds en français, s'il te plaît.",
    "日本語のテキストです。はい、元気です！",
    "Привет, как дела? Всё хорошо.",
    "The temperature is 21.5 °C — «très bien» — and it is 14:05 in Zürich.",
    "You are a helpful assistant. Cutting Knowledge Date: December 2023. Today Date: 26 Jul 2024.",
    "Environment: ipython. You can call the functions listed below.",
    "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}",
    "{\n    \"type\": \"function\",\n    \"function\": {\n        \"name\": \"get_time\"\n    }\n}",
    "system\nuser\nassistant\nmodel\nipython\ntool\n",
]


def corpus() -> list[str]:
    rng = random.Random(2024)
    lines = []
    for _ in range(3000):
        n = rng.randint(1, 3)
        lines.append(" ".join(
            f"{rng.choice(SUBJECTS).capitalize() if rng.random() < 0.5 else rng.choice(SUBJECTS)} {rng.choice(VERBS)} "
            f"{rng.choice(OBJECTS)}{rng.choice(TAILS)}" for _ in range(n)))
    for _ in range(4000):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 14))]
        words[0] = words[0].capitalize()
        lines.append(" ".join(words) + rng.choice(TAILS))
    for _ in range(20):
        lines.extend(EXTRA_TEXT)
    for template, _, _ in TEMPLATES.values():
        lines.extend([template] * 5)
    return lines


def train_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    lines = corpus()
    tok.train_from_iterator(lines, trainer=trainer, length=len(lines))
    return tok


def hf_tokenizer(tok_path: str, template: str, special: dict):
    return PreTrainedTokenizerFast(tokenizer_file=tok_path, chat_template=template, **special)


def render_conversation(hf, c: dict) -> dict:
    kwargs = dict(c.get("extra", {}))
    if "tools" in c:
        kwargs["tools"] = c["tools"]
    out = dict(c)
    try:
        text = hf.apply_chat_template(c["messages"], add_generation_prompt=c["add_generation_prompt"], tokenize=False, **kwargs)
    except Exception as e:  # noqa: BLE001 - the message is the oracle
        out["error"], out["error_type"] = str(e), type(e).__name__
        return out
    enc = hf.apply_chat_template(c["messages"], add_generation_prompt=c["add_generation_prompt"], tokenize=True, **kwargs)
    ids = enc["input_ids"] if not isinstance(enc, list) else enc
    ids = list(ids)
    # The assertion these fixtures rely on: apply_chat_template(tokenize=True) is the plain encoding of
    # the rendered text, without the tokenizer's own special tokens.
    assert ids == hf(text, add_special_tokens=False)["input_ids"], c["name"]
    assert all(isinstance(i, int) for i in ids)
    out["text"], out["ids"] = text, ids
    return out


NOTES = ("Rendered by transformers' apply_chat_template, whose Jinja context is: the tokenizer's special tokens "
         "(special_tokens; bos_token absent where not listed), then messages (message keys whose value is None are "
         "dropped first), tools (None when absent, not undefined), documents (None), add_generation_prompt, and the "
         "entries of extra. ids: apply_chat_template(tokenize=True), equal to tokenizer(text, add_special_tokens=False).")


def templates_json(tok_path: str) -> dict:
    out = {"generated_by": f"{GENERATED_BY} and tokenizers {tokenizers.__version__}", "tokenizer": "tokenizer.json",
           "notes": NOTES, "templates": {}}
    for name, (template, special, convs) in TEMPLATES.items():
        hf = hf_tokenizer(tok_path, template, special)
        rendered = [render_conversation(hf, c) for c in convs]
        assert any("error" in r for r in rendered), name
        out["templates"][name] = {"template": template, "special_tokens": special, "conversations": rendered}
    return out


# --------------------------------------------------------------------------------------------
# tokenizer_config files, chat.jsonl
# --------------------------------------------------------------------------------------------

EOS_ADDED = {"content": "<|eot_id|>", "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
             "special": True}


def config_files() -> dict:
    return {
        "tokenizer_config.json": {"chat_template": LLAMA3, "bos_token": "<|begin_of_text|>", "eos_token": EOS_ADDED,
                                  "tokenizer_class": "PreTrainedTokenizerFast"},
        "tokenizer_config_list.json": {"chat_template": [{"name": "default", "template": CHATML},
                                                         {"name": "tool_use", "template": CHATML_QWEN25}],
                                       "eos_token": "<|im_end|>",
                                       "tokenizer_class": "PreTrainedTokenizerFast"},
    }


def load_config(out: str, cfg: dict):
    """AutoTokenizer.from_pretrained on a folder holding tokenizer.json and cfg as tokenizer_config.json."""
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(out, "tokenizer.json"), "rb") as f, open(os.path.join(tmp, "tokenizer.json"), "wb") as g:
            g.write(f.read())
        with open(os.path.join(tmp, "tokenizer_config.json"), "w", encoding="utf-8") as g:
            g.write(dumps(cfg))
        return AutoTokenizer.from_pretrained(tmp)


def config_cases(out: str) -> dict:
    """Load each config next to tokenizer.json the way from_pretrained does and render with it. transformers 5
    refuses an AddedToken dict without "__type": "AddedToken" (older tokenizer_config.json files have it, newer
    ones write plain strings): that refusal is recorded as load_error and the config loaded again with it."""
    cases = []
    for fname, cfg in config_files().items():
        entry = {"file": fname}
        try:
            hf = load_config(out, cfg)
        except Exception as e:  # noqa: BLE001
            entry["load_error"] = str(e)
            cfg = {k: ({"__type": "AddedToken", **v} if isinstance(v, dict) else v) for k, v in cfg.items()}
            entry["loaded_with"] = 'AddedToken dicts given "__type": "AddedToken"'
            hf = load_config(out, cfg)
        entry.update(bos_token=hf.bos_token, eos_token=hf.eos_token, renders=[])
        for c in [conv("plain", [SYS, U1, A1], False), conv("gen", [U1], True),
                  conv("with_tools", [U_WEATHER], True, tools=[WEATHER_TOOL])]:
            entry["renders"].append(render_conversation(hf, c))
        cases.append(entry)
    return {"generated_by": GENERATED_BY, "cases": cases}


TOPICS = [
    ("How do I boil an egg?", "Put it in boiling water for about nine minutes, then cool it in cold water."),
    ("Translate 'good morning' to French.", "Bonjour."),
    ("What is 12 * 12?", "144."),
    ("Name three primary colours.", "Red, yellow and blue."),
    ("Écris une phrase en français.", "Voici une phrase en français, avec des accents : é, è, à, ç."),
    ("日本の首都はどこですか？", "東京です。"),
    ("Give me a haiku about rain.", "Soft rain on the roof\nthe gutters hum a slow song\nnight drinks every drop"),
    ("List two fruits, one per line.", "- apple\n- pear"),
    ("Say hi with an emoji.", "Hi! 👋😀"),
    ("What's the weather like on Mars?", "Cold and dusty: around −60 °C on average."),
    ("Спасибо!", "Пожалуйста!"),
    ("Explain recursion in one line.", "A function that calls itself on a smaller problem until a base case."),
    ("Write JSON with a key a set to 1.", "{\"a\": 1}"),
    ("  Why is the sky blue?  \n", "\nRayleigh scattering: blue light scatters more than red.\n"),
    ("Tab\tseparated\tvalues?", "Yes:\ta\tb\tc"),
]
SYSTEMS = ["You are a helpful assistant.", "Answer briefly.", "Tu es un assistant serviable.", "Reply in English only.\nBe polite."]


def chat_jsonl() -> bytes:
    rng = random.Random(40)
    lines = []
    for i in range(40):
        msgs = []
        if i % 3 == 0:
            msgs.append({"role": "system", "content": rng.choice(SYSTEMS)})
        for _ in range(1 + i % 3):
            q, a = rng.choice(TOPICS)
            msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        lines.append(json.dumps({"messages": msgs}, ensure_ascii=i % 5 == 4))
    return ("\n".join(lines) + "\n").encode("utf-8")


def chat_bad_jsonl() -> bytes:
    recs = [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]},
            {"messages": "Hi, I am not a list"},
            {"conversation": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}]
    return ("\n".join(json.dumps(r, ensure_ascii=False) for r in recs) + "\n").encode("utf-8")


def chat_rendered(tok_path: str, jsonl: bytes) -> dict:
    records = [json.loads(line) for line in jsonl.decode("utf-8").splitlines()]
    out = {"generated_by": GENERATED_BY, "templates": {}}
    for name in ["llama3", "chatml_qwen25"]:
        template, special, _ = TEMPLATES[name]
        hf = hf_tokenizer(tok_path, template, special)
        rows = []
        for i, rec in enumerate(records):
            r = render_conversation(hf, conv(f"line{i + 1}", rec["messages"], False))
            assert "error" not in r, (name, i)
            rows.append({"text": r["text"], "ids": r["ids"]})
        out["templates"][name] = rows
    return out


# --------------------------------------------------------------------------------------------

def write(path: str, data) -> None:
    with open(path, "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode("utf-8"))


def build(out: str) -> None:
    os.makedirs(out, exist_ok=True)
    write(os.path.join(out, "jinja_cases.json"), dumps(jinja_cases()))
    tok_path = os.path.join(out, "tokenizer.json")
    write(tok_path, dumps(json.loads(train_tokenizer().to_str())))
    write(os.path.join(out, "templates.json"), dumps(templates_json(tok_path)))
    for fname, cfg in config_files().items():
        write(os.path.join(out, fname), dumps(cfg))
    write(os.path.join(out, "config_cases.json"), dumps(config_cases(out)))
    jsonl = chat_jsonl()
    write(os.path.join(out, "chat.jsonl"), jsonl)
    write(os.path.join(out, "chat_bad.jsonl"), chat_bad_jsonl())
    write(os.path.join(out, "chat_rendered.json"), dumps(chat_rendered(tok_path, jsonl)))


if __name__ == "__main__":
    sys.exit(fixture_cli.main(build, os.path.join(ROOT, "test", "fixtures", "chat"), __doc__))
