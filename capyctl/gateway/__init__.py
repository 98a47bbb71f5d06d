"""The ``/v1`` gateway: one OpenAI-compatible endpoint in front of every deployment.

A lean ASGI app outside Django's view and middleware path. It authenticates the key,
resolves the model, asks the scheduler to make it ready (many waiting requests, one wake),
then streams the request to the engine and the answer back as it comes.
"""
