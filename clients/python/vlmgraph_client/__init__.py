"""Python client for the vlmgraph server (gRPC API in proto/vlmgraph/v1/).

    from vlmgraph_client import VlmGraphClient, build_prompt, image_tiles
    python3 -m vlmgraph_client --help        # command-line interface
"""
from .client import VlmGraphClient, encoded_image, tensor_image  # noqa: F401
from .prompt import build_prompt, image_size, image_tiles, resized_size, tiles_for_size  # noqa: F401
from .protos import build_protos, load as load_protos  # noqa: F401
