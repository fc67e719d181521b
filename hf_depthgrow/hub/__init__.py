"""Loading, saving, model cards and pushing to the Hugging Face Hub."""

from .loading import HubUnreachable, check_quantizable, load_model, load_pretrained, load_tokenizer
from .model_card import CardInfo, render_model_card
from .push import push_model_to_hub, push_to_hub
from .serialization import save_pretrained

__all__ = ["CardInfo", "HubUnreachable", "check_quantizable", "load_model", "load_tokenizer", "load_pretrained", "push_model_to_hub", "push_to_hub", "render_model_card", "save_pretrained"]
