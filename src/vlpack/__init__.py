"""vlpack: packed-sequence (THD) supervised fine-tuning for the Qwen vision-language family."""

__version__ = "0.1.0"
