"""Child process for the resume tests: load session files, generate from each, print the tokens as JSON.

usage: python resume.py MODEL PRECISION N SESSION_FILE [SESSION_FILE ...]
prints {"runs": [{"tokens": [...], "forwards_during_load": 0}, ...]}
"""
import json
import sys

from kvsession.engine import Engine
from kvsession.generate import generate_tokens
from kvsession.session import Session

model, precision, n, paths = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
engine = Engine.load(model, device="cpu", precision=precision)
runs = []
for path in paths:
    before = engine.model.n_forward
    session = Session.load(path, engine)
    loaded = engine.model.n_forward - before
    runs.append({"tokens": list(generate_tokens(session, n, ignore_eos=True)), "forwards_during_load": loaded})
print(json.dumps({"runs": runs}))
