"""onboxctl: the local controller. May import onbox (schemas); onbox never imports it."""
