"""Backbone adapters: all model knowledge lives here."""
from .base import BackboneAdapter, Conditioning, GenerationDefaults
from .registry import adapter_for, register_adapter, supported_pipelines

__all__ = ["BackboneAdapter", "Conditioning", "GenerationDefaults", "adapter_for", "register_adapter", "supported_pipelines"]
