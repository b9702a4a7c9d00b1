"""The conversation contract shared by sf-regen and sf-capture (and sf-eval's prompt sets).

- records: the shapes accepted, one record normalised into a Conversation, or a BadInput naming
  what is wrong with it;
- sources: files, folders of them, and sf-regen outputs, loaded in a deterministic order;
- regen_format: sf-regen's output folder (its writer and reader, FORMAT_VERSION, the versions it
  reads; an unknown version is refused);
- templates: what a chat template must render for a conversation, and the prompt it renders.
"""
