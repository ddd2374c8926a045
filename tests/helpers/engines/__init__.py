"""What the real-engine tests (tests/integrations/engines) share: the tiny model, the engines' cases."""
