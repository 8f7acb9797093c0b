"""Child process for the resume tests: load a session file, generate, print the tokens as JSON.

usage: python resume.py MODEL PRECISION SESSION_FILE N
"""
import json
import sys

from kvsession.engine import Engine
from kvsession.generate import generate_tokens
from kvsession.session import Session

model, precision, path, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
engine = Engine.load(model, device="cpu", precision=precision)
session = Session.load(path, engine)
loaded_forwards = engine.model.n_forward
tokens = list(generate_tokens(session, n))
print(json.dumps({"tokens": tokens, "forwards_during_load": loaded_forwards,
                  "logits0": None}))
