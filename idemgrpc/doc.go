/*
Package idemgrpc makes unary gRPC methods exactly-once per client key, on
PostgreSQL: it does for gRPC what idemhttp does for HTTP.

A server interceptor runs each covered call's handler in a transaction,
with the key's claim and the stored answer, so that a call either happens
once, with its answer saved for retries, or leaves no trace at all:

	interceptor, err := idemgrpc.NewServerInterceptor(pool, idemgrpc.Config{
		Scope: func(ctx context.Context) (string, error) {
			return tenantID(ctx) // the authenticated caller
		},
		Required: true,
	})
	if err != nil {
		return err // names the field, and wraps idem.ErrInvalidOption
	}
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(authenticate, interceptor))

	func (s *payments) Create(ctx context.Context, req *pb.CreateRequest) (*pb.Payment, error) {
		tx := idemgrpc.Tx(ctx)
		// ... INSERT on tx, then return the response as usual.
	}

On the client, [MustNewClientInterceptor] gives every call a key and keeps it
across retries.

For each covered call with a key, the interceptor claims (scope, key), runs
the handler, stores its response message (in the protobuf wire format, with
the name of its type) or its error (see [Config.Store]), with the header
and trailer metadata the handler set, and commits; only then does the
client get the answer. A retry gets the same response message again,
rebuilt from the stored bytes as the type the registry names, and the same
metadata, marked with the header metadata idempotent-replayed: true. A
duplicate that arrives while the first call is still running waits for it,
up to [Config.Wait], and gets its answer.

The key comes from the metadata idempotency-key ([Config.Metadata]), or
from a field of the request ([Config.KeyField], such as AIP-155's
request_id). Two calls with the same key are the same call when their
fingerprints match: by default the full method name and the request in
protobuf's deterministic serialization, without the key's field, so that
the order of a map's entries never makes a retry look like another
request.

Every error the interceptor answers itself carries a google.rpc.ErrorInfo
with the domain [ErrorDomain] and a stable reason, [ReasonKeyMissing] and
the constants after it; ABORTED for a call still in progress also carries
a google.rpc.RetryInfo. The table of codes and reasons, what a client
should retry, and Connect through idemhttp are in
https://github.com/pgidem/idem/blob/main/docs/grpc.md.

# Configuration

[NewServerInterceptor] checks a [Config] once, applies its defaults, and
refuses a field that cannot work with an error that names it and wraps
[idem.ErrInvalidOption]. In a Config, zero means the default, which each
field states, and a negative value means none where that makes sense: no
wait ([Config.Wait]), no limit ([Config.MaxResponseBytes]). A nil Logger is
slog.Default().

# Which calls are covered

Every unary method, unless [Config.Methods] lists some; streaming calls
always pass through untouched, and so do the calls of a method without
side effects, whatever the configuration: a method of gRPC's own read-only
services (grpc.health.v1.Health, grpc.reflection.v1 and v1alpha
ServerReflection, grpc.channelz.v1.Channelz), or one whose descriptor in
protobuf's global registry says option idempotency_level =
NO_SIDE_EFFECTS. Such a call changes nothing that a key would protect, so
health checks answer with [Config.Required] set, and no probe opens a
transaction or stores a record; [MustNewClientInterceptor] gives it no key. A
covered call with a key runs as above. A
covered call without one gets INVALID_ARGUMENT when a key is required
([Config.Required], [Config.Optional]), and otherwise runs its handler in a
transaction of its own, with nothing claimed or stored, so that the
handler's code is the same either way. A call of a method that is not
covered passes straight to the handler, outside any transaction.

# Writing handlers

The handler finds its transaction with [Tx] and does every write on it; it
must not commit or roll it back. [Key] and [Scope] name the call's
operation. Requests and responses must be protobuf messages, and a
response's type must be in protobuf's global registry, where a replay
finds it again: generated code registers its types there, and protobuf's
well-known types are there, for a service written without protoc (see
ExampleRunFlow).

The header metadata that the handler sets or sends (grpc.SetHeader,
grpc.SendHeader) and its trailer (grpc.SetTrailer) are held until the
transaction commits, and then sent with the answer: SendHeader sends
nothing early. grpc.SetSendCompressor and grpc.ClientSupportedCompressors
do not work under the interceptor. Metadata with credentials
(authorization, cookies) is sent to the first caller but never stored or
replayed.

A statement that fails aborts the whole transaction, which then cannot
commit: catch expected failures inside a savepoint (tx.Begin). When
PostgreSQL aborts the transaction at commit to resolve a serialization
failure or a deadlock, the handler runs again in a new one, so it must do
nothing a rollback cannot undo, such as calling another service without an
idempotency key of its own ([Key] helps derive one).

An error that [Config.Store] keeps (by default a definite answer, such as
INVALID_ARGUMENT or FAILED_PRECONDITION: [StoreDefinite]) commits with the
handler's writes and is replayed with its code, message and details; one
it refuses (UNAVAILABLE, INTERNAL, ...) goes to the client as the handler
returned it and rolls back, so that a retry runs the handler again. A
panic rolls back and goes on up the interceptor chain, to a recovery
interceptor if there is one. When the client goes away mid-call, the
call's context is cancelled, the transaction rolls back, and the client's
retry runs the handler again.

# Flows

A method whose write calls another system (charging a card) is served by
an [idem.Flow] rather than in a transaction, which would be held across
the call: list it in [Config.Flows], and its handler runs the flow with
[RunFlow], under the call's key, scope and fingerprint, and builds its
response from the flow's answer. RunFlow states the statuses it answers.

# Privacy and observability

A stored answer holds the response and its metadata, often personal data.
[Config.Codec] seals them (see [idem.Codec]) and [Config.Observer] records
each keyed call's outcome, claim duration and span (see [idem.Observer]).
*/
package idemgrpc
