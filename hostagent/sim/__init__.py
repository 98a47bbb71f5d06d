"""Simulated engines: ``python -m hostagent.sim vllm|sglang|llamacpp|tensorfold ARGS``.

Each parses its command line as the real program does (its real flags, ``flags.py``; any
other is refused as the real one refuses it) and serves the real engine's routes (OpenAI
routes with streaming, health, sleep/wake or release/resume; docs/engines.md), with
knobs for timing and switches for faults, read from the environment:

==============================  ===================================================
``CAPYCTL_SIM_LOAD_SECONDS``    time to "load the model" before becoming healthy
``CAPYCTL_SIM_SLEEP_SECONDS``   time a park (sleep / release) takes
``CAPYCTL_SIM_WAKE_SECONDS``    time a wake takes
``CAPYCTL_SIM_DEEP_SLEEP_SECONDS`` time a deep park takes (default: the sleep seconds)
``CAPYCTL_SIM_DEEP_WAKE_SECONDS`` time a wake from a deep park takes in all, spent reloading
                                the weights (default: each wake call's wake seconds)
``CAPYCTL_SIM_TOKENS_PER_SECOND`` streaming pace (0: as fast as possible)
``CAPYCTL_SIM_COMPLETION_TOKENS`` tokens in each answer (default 8)
``CAPYCTL_SIM_GPU_BYTES``       claim per GPU (default: the engine's fraction of the device)
``CAPYCTL_SIM_WEIGHTS_BYTES``   weights per GPU (default: half the claim)
``CAPYCTL_SIM_RESIDUAL_BYTES``  what stays on the GPU while parked (default 256MiB)
``CAPYCTL_SIM_CRASH_AFTER``     exit abruptly on the request after this many
``CAPYCTL_SIM_HANG_ON_WAKE``    1: a wake never returns
``CAPYCTL_SIM_LOAD_GATE``       a file: the load is held until it exists (``FILE.waiting``
                                appears while it is)
``CAPYCTL_SIM_WAKE_GATE``       a file: a wake is held until it exists (``FILE.waiting``
                                appears when one is)
``CAPYCTL_SIM_KEEP_MEMORY``     1: a park answers 200 but keeps the GPU memory
``CAPYCTL_SIM_DIE_MID_STREAM``  1: exit abruptly after the second streamed chunk
``CAPYCTL_SIM_RECORD``          a file: one JSON line for each request received
==============================  ===================================================

GPU memory is "allocated" in the simulated devices of ``CAPYCTL_SIM_GPUS`` (the GPUs in
``CUDA_VISIBLE_DEVICES``) and recorded in ``CAPYCTL_SIM_STATE_DIR``, where the simulated
probe reads it.
"""
