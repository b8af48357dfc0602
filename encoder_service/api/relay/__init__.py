"""The relay processes of ``--grpc-processes``: ``process.py`` is one relay (it serves the public
port and passes every call on to the server process's unix socket), ``supervisor.py`` the server
process's side that starts, restarts and stops them, ``regions.py`` their shared memory, handed to
the server process by descriptor.

A package of its own because a relay process imports only this and what it names (no engine, no
torch): nothing here may import the servicer or the server.
"""
