"""The Responses API: /v1/responses and its stored responses.

    router.py      POST /v1/responses, GET and DELETE /v1/responses/{id}
    tool_types.py  its tool types (function, custom, namespace, local_shell), and the items calls become
    stored.py      stored responses, on disk within a budget
"""
