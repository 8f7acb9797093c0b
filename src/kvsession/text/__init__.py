"""Text <-> tokens: the tokenizer read from the GGUF file, and the chat template that renders a conversation.

    tokenizer.py  llama.cpp's vocabularies (BPE, SentencePiece) through `tokenizers`, streaming decode
    template.py   the file's Jinja chat template: ChatPrompt, literals that stay text, tools
"""
