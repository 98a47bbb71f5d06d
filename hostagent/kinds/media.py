"""Where an engine may fetch a request's media from: vLLM's and SGLang's
``--allowed-media-domains``.

Both engines fetch the ``http(s)`` image, audio and video URLs a chat names, from the GPU
host. Both take ``--allowed-media-domains HOST...`` (vLLM ``vllm/config/model.py``, checked
in ``vllm/multimodal/media/connector.py``; SGLang ``srt/arg_groups/fields/mm.py``): the URL's
host must be one of them exactly, and newer releases check every redirect hop too. An empty
or missing list means *every* host, so a deployment that allows none is launched with a
name that never resolves (:data:`NO_MEDIA_DOMAIN`). The gateway refuses such URLs first;
this is the engine's own line behind it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hostagent.kinds.base import LaunchSpec

FLAG = "--allowed-media-domains"
# RFC 2606: ``.invalid`` never resolves. Also in capyctl.deployments.guards (no import:
# the host agent stays free of the control plane).
NO_MEDIA_DOMAIN = "media.invalid"


def media_domain_flags(spec: LaunchSpec) -> list[str]:
    """``--allowed-media-domains`` with the launch's media domains (or the name that never
    resolves), where the launch carries a media policy and this build lists the flag."""
    if spec.media_domains is None or spec.features is None or not spec.features.has(FLAG):
        return []
    return [FLAG, *(spec.media_domains or [NO_MEDIA_DOMAIN])]
