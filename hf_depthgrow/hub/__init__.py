"""Saving, loading, model cards and pushing to the Hugging Face Hub."""

from .model_card import CardInfo, render_model_card
from .push import push_model_to_hub, push_to_hub
from .serialization import load_pretrained, save_pretrained
