"""Authentication and authorization: SASL PLAIN/SCRAM (server side), ACLs (sans-IO) and the
per-API authorizer over the store, the client side of a listener's TLS/SASL for Scroll's own clients."""
