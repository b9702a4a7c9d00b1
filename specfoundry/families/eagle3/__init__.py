"""The EAGLE-3 family: its draft model, Training-Time Test loss and SGLang export."""
