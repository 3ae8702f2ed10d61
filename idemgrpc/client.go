package idemgrpc

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/adapter"
)

// ClientOption changes the interceptor that [NewClientInterceptor] returns.
type ClientOption func(*clientSettings) error

// WithKeyGenerator makes the interceptor take each fresh key from newKey,
// which must return 1 to 255 bytes of printable ASCII and a new key on
// every call. Defaults to a random UUID (version 4), as AIP-155 asks of a
// request_id.
func WithKeyGenerator(newKey func() string) ClientOption {
	return func(s *clientSettings) error {
		if newKey == nil {
			return adapter.Invalid("idemgrpc", "WithKeyGenerator", "needs a function, got nil")
		}
		s.newKey = newKey
		return nil
	}
}

// WithMetadata makes the interceptor send keys in the metadata key, which
// must be the server's [Config.Metadata]. Defaults to [DefaultMetadata].
func WithMetadata(key string) ClientOption {
	return func(s *clientSettings) error {
		key = strings.ToLower(key)
		if problem := checkMetadataKey(key); problem != "" {
			return adapter.Invalid("idemgrpc", "WithMetadata", "%q %s", key, problem)
		}
		s.metadata = key
		return nil
	}
}

// WithKeyField makes the interceptor put keys in the string field of that
// name of the request messages that have one, as AIP-155's request_id,
// instead of the metadata: a request whose field is set keeps its key, and
// one whose field is empty is sent as a copy with a fresh key in it (the
// caller's message is left as it is). Use it with the server's
// [Config.KeyField]. Defaults to none.
func WithKeyField(name string) ClientOption {
	return func(s *clientSettings) error {
		if !protoreflect.Name(name).IsValid() {
			return adapter.Invalid("idemgrpc", "WithKeyField", "%q is not a protobuf field name", name)
		}
		s.keyField = protoreflect.Name(name)
		return nil
	}
}

// WithProviderKey makes the interceptor send, on a call made from a flow's
// call (whose context carries the call's provider key,
// [idem.ProviderKeyFromContext]), that key instead of a fresh one, in the
// metadata or the request's key field (see [WithKeyField]), so that every
// attempt of the flow's call, in every process, reaches the other system
// with the same key without the call's function naming it. A call that
// carries the same key already is sent as it is; one that carries another
// (in the metadata or the key field) is refused before anything is sent,
// with an error that wraps [ErrKeyConflict] and whose status is
// INVALID_ARGUMENT. A call whose context carries no provider key gets a
// fresh key as without the option. Defaults to off.
func WithProviderKey() ClientOption {
	return func(s *clientSettings) error {
		s.useProviderKey = true
		return nil
	}
}

// ErrKeyConflict is in the chain of the error the client interceptor
// returns, with [WithProviderKey], before anything is sent, for a call
// made from a flow's call that already carries a key other than the
// call's provider key: sent, it would reach the server under a key that
// the call's next attempt, after a crash, would not send again. The error
// wraps [idem.ErrInvalidKey] and [idem.ErrNotSent] too, and its status is
// INVALID_ARGUMENT.
var ErrKeyConflict = errors.New("idemgrpc: the call carries a key other than its flow call's provider key")

// clientSettings are the client interceptor's options, applied.
type clientSettings struct {
	newKey         func() string
	metadata       string
	keyField       protoreflect.Name
	useProviderKey bool
}

// retryAttemptMetadata is the metadata key that go-grpc-middleware's retry
// interceptor sets on every attempt after the first.
const retryAttemptMetadata = "x-retry-attempt"

// NewClientInterceptor returns a unary client interceptor that gives a call
// without an idempotency key a fresh one, in the metadata [DefaultMetadata]
// (see [WithMetadata], [WithKeyField]), so that every retry of the call is
// one logical operation for a server with [NewServerInterceptor]. A call
// that carries a key already, set by the caller with
// metadata.AppendToOutgoingContext, keeps it: that is how a caller that
// must restart an operation, after a crash say, resends it with its key.
// A call of a method without side effects, which the server interceptor
// never covers (see "Which calls are covered" in the package
// documentation), gets no key.
//
// The key stays the same across every attempt that happens beneath the
// interceptor: gRPC's own retries (a retryPolicy in the service config,
// and its transparent retries), and those of an interceptor chained after
// this one, such as go-grpc-middleware's retry interceptor:
//
//	grpc.WithChainUnaryInterceptor(
//		idemgrpc.MustNewClientInterceptor(), // first: one key per logical call
//		retry.UnaryClientInterceptor(retry.WithCodes(codes.Unavailable, codes.Aborted)),
//	)
//
// Chained the other way round, every attempt would get a key of its own
// and a retry could run the call twice; an attempt that go-grpc-middleware
// marks as a retry (metadata x-retry-attempt) and that reaches this
// interceptor without a key therefore fails with INTERNAL instead of being
// sent with a fresh key.
//
// In a flow's call, [WithProviderKey] sends the call's provider key
// instead of a fresh one, the same in every attempt and every process.
// With [SendTracker] given to the connection, the error of a call that
// surely never left the client wraps [idem.ErrNotSent]; every other error
// is returned as the call got it.
//
// Each key is generated once per call, so calls that do not change
// anything cost only the key. An option that cannot work is refused with a
// [*idem.FieldError] that names it and wraps [idem.ErrInvalidOption].
func NewClientInterceptor(opts ...ClientOption) (grpc.UnaryClientInterceptor, error) {
	s := clientSettings{newKey: adapter.NewUUID, metadata: DefaultMetadata}
	for _, opt := range opts {
		if err := opt(&s); err != nil {
			return nil, err
		}
	}
	return s.intercept, nil
}

// MustNewClientInterceptor is [NewClientInterceptor] that panics with its
// error instead of returning it, so that a mistake stops the program at
// its start; it is written where a connection is dialled:
//
//	grpc.WithChainUnaryInterceptor(idemgrpc.MustNewClientInterceptor())
func MustNewClientInterceptor(opts ...ClientOption) grpc.UnaryClientInterceptor {
	i, err := NewClientInterceptor(opts...)
	if err != nil {
		panic(err)
	}
	return i
}

func (s *clientSettings) intercept(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn,
	invoker grpc.UnaryInvoker, opts ...grpc.CallOption,
) error {
	ctx, req, err := s.withKey(ctx, method, req)
	if err != nil {
		return err
	}
	ctx, sends := trackSends(ctx)
	err = invoker(ctx, method, req, reply, cc, opts...)
	if err != nil && sends.noneSent() {
		return &notSentError{err: err}
	}
	return err
}

// withKey returns the context and request to send for a call of method
// with req: with the call's key, the caller's, or none.
func (s *clientSettings) withKey(ctx context.Context, method string, req any) (context.Context, any, error) {
	if hasNoSideEffects(method) {
		return ctx, req, nil
	}
	md, _ := metadata.FromOutgoingContext(ctx)
	msg, _ := req.(proto.Message)
	var field protoreflect.FieldDescriptor
	if msg != nil && s.keyField != "" {
		field = msg.ProtoReflect().Descriptor().Fields().ByName(s.keyField)
		if field != nil && (field.Kind() != protoreflect.StringKind || field.Cardinality() == protoreflect.Repeated) {
			field = nil
		}
	}
	inField := ""
	if field != nil {
		inField = msg.ProtoReflect().Get(field).String()
	}
	key := ""
	if providerKey, ok := idem.ProviderKeyFromContext(ctx); ok && s.useProviderKey {
		if err := s.checkCallersKeys(method, providerKey, md.Get(s.metadata), inField); err != nil {
			return ctx, req, err
		}
		key = providerKey
	}
	if len(md.Get(s.metadata)) > 0 || inField != "" {
		return ctx, req, nil
	}
	if key == "" {
		if len(md.Get(retryAttemptMetadata)) > 0 {
			return ctx, req, status.Error(codes.Internal, "idemgrpc: the client interceptor runs beneath a retry interceptor, "+
				"so that each attempt would get a key of its own: chain idemgrpc.MustNewClientInterceptor() before the retry interceptor")
		}
		key = s.newKey()
	}
	if field != nil {
		withKey := proto.Clone(msg)
		withKey.ProtoReflect().Set(field, protoreflect.ValueOfString(key))
		return ctx, withKey, nil
	}
	return metadata.AppendToOutgoingContext(ctx, s.metadata, key), req, nil
}

// checkCallersKeys refuses a call whose keys, those of its metadata and
// the one in its key field, are not all the call's provider key.
func (s *clientSettings) checkCallersKeys(method, providerKey string, inMetadata []string, inField string) error {
	where, other := "", ""
	for _, v := range inMetadata {
		if v != providerKey {
			where, other = "metadata "+s.metadata, v
		}
	}
	if inField != "" && inField != providerKey {
		where, other = "field "+string(s.keyField), inField
	}
	if where == "" {
		return nil
	}
	return &keyConflictError{msg: fmt.Sprintf("idemgrpc: %s: the call's %s holds %q, and its flow call's provider key is %q: "+
		"leave the key to the interceptor, or set it to the call's provider key", method, where, other, providerKey)}
}

// keyConflictError is a call refused by [WithProviderKey].
type keyConflictError struct{ msg string }

func (e *keyConflictError) Error() string { return e.msg }

func (e *keyConflictError) Unwrap() []error {
	return []error{ErrKeyConflict, idem.ErrInvalidKey, idem.ErrNotSent}
}

func (e *keyConflictError) GRPCStatus() *status.Status {
	return status.New(codes.InvalidArgument, e.msg)
}
