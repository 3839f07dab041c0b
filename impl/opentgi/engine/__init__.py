"""The generation engine: knows nothing of HTTP or of any API dialect (never imports opentgi.api or
opentgi.schemas). Entry point: `opentgi.engine.engine.Engine`."""
