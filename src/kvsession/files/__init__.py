"""The bytes on disk: how a session and the store's entries are framed, written and read back checked.

    framing.py       magic, version, header, sections, checksums, crash-safe writes (every file kind's frame)
    session_file.py  the session file (.kvs): what its header holds, a SessionState written and read
    raw_file.py      the seed's raw layout: layer blobs and a JSON manifest, for interoperability
    named.py         named sessions: NAME.kvs in a folder, listed, checked, deleted
    fields.py        the JSON field checks every header and manifest goes through

Import order: named, raw_file > session_file > framing > fields. docs/file-format.md has the layouts.
"""
