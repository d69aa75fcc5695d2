"""slime's rollout, generate and reward function contracts, run unchanged (docs/slime-functions.md).

``contract``: detection by signature, the calls and the conversions to and from our ``Sample``; ``gateway``: the
SGLang-protocol ``/generate`` those functions post to, served by the run's engine call; ``args``: slime's
``args`` namespace; ``finder`` + ``shim/slime``: slime's import paths when no slime is installed; ``loop``: the
event loop their coroutines share."""
