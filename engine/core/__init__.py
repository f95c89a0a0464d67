"""The device-independent heart: ``EngineCore`` (the only step loop, a transaction per step),
turning prompts into requests, turning committed tokens into outputs, wiring the parts."""
