"""sf-regen: regenerate a conversation dataset's assistant turns with the target itself."""
