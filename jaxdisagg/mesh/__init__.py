"""Deployments: mesh configs, disjoint pool sub-meshes, sharded programs, KV transfer."""

from jaxdisagg.mesh.config import ConfigError, DeploymentConfig, load_config, parse_config
from jaxdisagg.mesh.deployment import Deployment, finish_transfer, prefill_request
from jaxdisagg.mesh.pool import PoolInstance
from jaxdisagg.mesh.transfer import InProcessTransfer, TransferStats

__all__ = [
    "ConfigError", "Deployment", "DeploymentConfig", "InProcessTransfer", "PoolInstance",
    "TransferStats", "finish_transfer", "load_config", "parse_config", "prefill_request",
]
