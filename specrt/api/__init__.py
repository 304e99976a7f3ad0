"""The session API: a loaded pair (`load`, `Pair`), the one resolver of a request's settings, text and
streaming, memory."""
