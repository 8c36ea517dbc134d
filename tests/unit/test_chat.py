"""Chat messages to a prompt (trickles/infer/chat.py): the plain template, a tokenizer's own Jinja chat template
(read from a Hugging Face tokenizer directory in each of its forms and kept when the tokenizer is saved), and a
template's refusal as a ValueError."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("tokenizers", exc_type=ImportError)  # the hf extra (CI installs it: a skip there fails)

from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402

from trickles.data import ByteTokenizer  # noqa: E402
from trickles.data.tokenizers import load_hf_tokenizer, load_tokenizer  # noqa: E402
from trickles.infer.chat import plain_template, render_chat  # noqa: E402

TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools') }}{% endif %}"
    "[{{ m.role }}]{{ m.content }}{{ eos_token }}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "hello"},
    {"role": "user", "content": "bye"},
]


def test_the_plain_template():
    assert plain_template(MESSAGES) == (
        "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\nhello<|end|>\n<|user|>\nbye\n<|assistant|>\n"
    )
    assert render_chat(MESSAGES, ByteTokenizer()) == plain_template(MESSAGES)  # no template of its own
    assert plain_template([{"role": "developer", "content": "x"}]) == "<|system|>\nx\n<|assistant|>\n"


def _hf_dir(path, config: dict, jinja: str | None = None):
    tk = Tokenizer(models.WordLevel({"hi": 0, "</s>": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    path.mkdir()
    tk.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", **config}))
    if jinja is not None:
        (path / "chat_template.jinja").write_text(jinja)
    return path


@pytest.mark.parametrize(
    "config,jinja",
    [
        ({"chat_template": TEMPLATE}, None),
        ({"chat_template": [{"name": "tool_use", "template": "x"}, {"name": "default", "template": TEMPLATE}]}, None),
        ({"chat_template": "ignored: the file wins"}, TEMPLATE),
    ],
    ids=["string", "named-list", "jinja-file"],
)
def test_a_tokenizer_chat_template_is_read_kept_and_rendered(tmp_path, config, jinja):
    tok = load_hf_tokenizer(_hf_dir(tmp_path / "hf", config, jinja))
    assert tok.chat_template == TEMPLATE
    tok.save(tmp_path / "saved")
    again = load_tokenizer(tmp_path / "saved")
    assert again.chat_template == TEMPLATE
    assert render_chat(MESSAGES[1:3], again) == "[user]hi</s>[assistant]hello</s>[assistant]"
    with pytest.raises(ValueError, match="no tools"):
        render_chat([{"role": "tool", "content": "x"}], again)


def test_templates_render_as_transformers_renders_them():
    """Jinja's ``trim_blocks`` and ``lstrip_blocks``, as ``apply_chat_template`` sets them: a template written over
    several indented lines renders without their line breaks and indentation."""
    template = (
        "{% for m in messages %}\n    {% if m.role == 'user' %}\n<u>{{ m.content }}\n    {% endif %}\n"
        "{% endfor %}\n{% if add_generation_prompt %}<a>{% endif %}"
    )
    tok = ByteTokenizer()
    tok.chat_template = template
    assert render_chat(MESSAGES[1:2], tok) == "<u>hi\n<a>"


def test_a_tokenizer_without_a_template_has_none(tmp_path):
    assert load_hf_tokenizer(_hf_dir(tmp_path / "hf", {})).chat_template is None
