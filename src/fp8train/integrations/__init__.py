"""Integrations with the training frameworks people already use (transformers, accelerate, PEFT, Lightning)."""
