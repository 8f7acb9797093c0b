"""Chat templates by name, as `serve --chat-template NAME` takes them: llama.cpp's built-in formats (its
src/llama-chat.cpp, which llama-server applies for `--chat-template NAME`), each written here as a Jinja template
that renders the same text for system, user and assistant messages of plain text. Its tokenizer adds BOS, as
llama.cpp's does, so none of them writes one. What a name does not cover (tools, images, a format not listed) is
a template file's job (`--chat-template-file`).
"""
from __future__ import annotations

from ..errors import InvalidArgument


def _each(body: str, generation: str = "") -> str:
    """A template that writes `body` (Jinja expression text over m, the message) for every message, then
    `generation` when a reply is asked for."""
    gen = "{% if add_generation_prompt %}{{ " + generation + " }}{% endif %}" if generation else ""
    return "{% for m in messages %}{{ " + body + " }}{% endfor %}" + gen


# name -> Jinja source (Jinja's trim: llama.cpp's trim(), whitespace off both ends)
NAMED: dict[str, str] = {
    "chatml": _each("'<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n'", "'<|im_start|>assistant\\n'"),
    "llama3": _each("'<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content | trim + '<|eot_id|>'",
                    "'<|start_header_id|>assistant<|end_header_id|>\\n\\n'"),
    "llama4": _each("'<|header_start|>' + m.role + '<|header_end|>\\n\\n' + m.content | trim + '<|eot|>'",
                    "'<|header_start|>assistant<|header_end|>\\n\\n'"),
    "phi3": _each("'<|' + m.role + '|>\\n' + m.content + '<|end|>\\n'", "'<|assistant|>\\n'"),
    "phi4": _each("'<|im_start|>' + m.role + '<|im_sep|>' + m.content + '<|im_end|>'",
                  "'<|im_start|>assistant<|im_sep|>'"),
    "falcon3": _each("'<|' + m.role + '|>\\n' + m.content + '\\n'", "'<|assistant|>\\n'"),
    "zephyr": _each("'<|' + m.role + '|>\\n' + m.content + '<|endoftext|>\\n'", "'<|assistant|>\\n'"),
    "granite": _each("'<|start_of_role|>' + m.role + '<|end_of_role|>' + m.content + '<|end_of_text|>\\n'",
                     "'<|start_of_role|>assistant<|end_of_role|>\\n'"),
    "megrez": _each("'<|role_start|>' + m.role + '<|role_end|>' + m.content + '<|turn_end|>'",
                    "'<|role_start|>assistant<|role_end|>'"),
    "command-r": _each("'<|START_OF_TURN_TOKEN|>' + {'system': '<|SYSTEM_TOKEN|>', 'user': '<|USER_TOKEN|>', "
                       "'assistant': '<|CHATBOT_TOKEN|>'}[m.role] + m.content | trim + '<|END_OF_TURN_TOKEN|>' "
                       "if m.role in ('system', 'user', 'assistant') else ''",
                       "'<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>'"),
    "deepseek": _each("m.content if m.role == 'system' else '### Instruction:\\n' + m.content + '\\n' "
                      "if m.role == 'user' else '### Response:\\n' + m.content + '\\n<|EOT|>\\n' "
                      "if m.role == 'assistant' else ''", "'### Response:\\n'"),
    "deepseek2": _each("m.content + '\\n\\n' if m.role == 'system' else 'User: ' + m.content + '\\n\\n' "
                       "if m.role == 'user' else 'Assistant: ' + m.content + '<｜end▁of▁sentence｜>' "
                       "if m.role == 'assistant' else ''", "'Assistant:'"),
    "deepseek3": _each("m.content + '\\n\\n' if m.role == 'system' else '<｜User｜>' + m.content "
                       "if m.role == 'user' else '<｜Assistant｜>' + m.content + '<｜end▁of▁sentence｜>' "
                       "if m.role == 'assistant' else ''", "'<｜Assistant｜>'"),
    "vicuna": _each("m.content + '\\n\\n' if m.role == 'system' else 'USER: ' + m.content + '\\n' "
                    "if m.role == 'user' else 'ASSISTANT: ' + m.content + '</s>\\n' "
                    "if m.role == 'assistant' else ''", "'ASSISTANT:'"),
    "vicuna-orca": _each("'SYSTEM: ' + m.content + '\\n' if m.role == 'system' else 'USER: ' + m.content + '\\n' "
                         "if m.role == 'user' else 'ASSISTANT: ' + m.content + '</s>\\n' "
                         "if m.role == 'assistant' else ''", "'ASSISTANT:'"),
    "exaone3": _each("'[|system|]' + m.content | trim + '[|endofturn|]\\n' if m.role == 'system' else "
                     "'[|user|]' + m.content | trim + '\\n' if m.role == 'user' else "
                     "'[|assistant|]' + m.content | trim + '[|endofturn|]\\n' if m.role == 'assistant' else ''",
                     "'[|assistant|]'"),
    "mistral-v7": _each("'[SYSTEM_PROMPT] ' + m.content + '[/SYSTEM_PROMPT]' if m.role == 'system' else "
                        "'[INST] ' + m.content + '[/INST]' if m.role == 'user' else ' ' + m.content + '</s>'"),
    "mistral-v7-tekken": _each("'[SYSTEM_PROMPT]' + m.content + '[/SYSTEM_PROMPT]' if m.role == 'system' else "
                               "'[INST]' + m.content + '[/INST]' if m.role == 'user' else m.content + '</s>'"),
    # Gemma: no system turn; a system message's text opens the next user turn; "assistant" is "model"
    "gemma": "{% set ns = namespace(system='') %}{% for m in messages %}{% if m.role == 'system' %}"
             "{% set ns.system = ns.system + m.content | trim %}{% else %}"
             "{% set role = 'model' if m.role == 'assistant' else m.role %}"
             "{{ '<start_of_turn>' + role + '\\n' }}{% if ns.system and role != 'model' %}"
             "{{ ns.system + '\\n\\n' }}{% set ns.system = '' %}{% endif %}"
             "{{ m.content | trim + '<end_of_turn>\\n' }}{% endif %}{% endfor %}"
             "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}",
}


def named_template(value: str) -> str:
    """`--chat-template`'s value as a Jinja source: a name of NAMED, or a template written inline (it has Jinja's
    {{ or {% in it). Anything else is a clear error that lists the names, not a template that would write the
    name itself as every prompt."""
    if value in NAMED:
        return NAMED[value]
    if "{{" in value or "{%" in value:
        return value
    raise InvalidArgument(f"--chat-template {value!r}: not a template name ({', '.join(sorted(NAMED))}) nor an "
                          "inline Jinja template; a template in a file takes --chat-template-file")
