package idemgrpc

import (
	"context"
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
			return fmt.Errorf("%w: idemgrpc: WithKeyGenerator: needs a function, got nil", idem.ErrInvalidOption)
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
			return fmt.Errorf("%w: idemgrpc: WithMetadata: %q %s", idem.ErrInvalidOption, key, problem)
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
			return fmt.Errorf("%w: idemgrpc: WithKeyField: %q is not a protobuf field name", idem.ErrInvalidOption, name)
		}
		s.keyField = protoreflect.Name(name)
		return nil
	}
}

// clientSettings are the client interceptor's options, applied.
type clientSettings struct {
	newKey   func() string
	metadata string
	keyField protoreflect.Name
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
//		idemgrpc.NewClientInterceptor(), // first: one key per logical call
//		retry.UnaryClientInterceptor(retry.WithCodes(codes.Unavailable, codes.Aborted)),
//	)
//
// Chained the other way round, every attempt would get a key of its own
// and a retry could run the call twice; an attempt that go-grpc-middleware
// marks as a retry (metadata x-retry-attempt) and that reaches this
// interceptor without a key therefore fails with INTERNAL instead of being
// sent with a fresh key.
//
// Each key is generated once per call, so calls that do not change
// anything cost only the key. An option that cannot work makes
// NewClientInterceptor panic, with an error that wraps
// [idem.ErrInvalidOption], so that a mistake stops the program at its
// start.
func NewClientInterceptor(opts ...ClientOption) grpc.UnaryClientInterceptor {
	s := clientSettings{newKey: adapter.NewUUID, metadata: DefaultMetadata}
	for _, opt := range opts {
		if err := opt(&s); err != nil {
			panic(err)
		}
	}
	return s.intercept
}

func (s *clientSettings) intercept(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn,
	invoker grpc.UnaryInvoker, opts ...grpc.CallOption,
) error {
	md, _ := metadata.FromOutgoingContext(ctx)
	if len(md.Get(s.metadata)) > 0 || hasNoSideEffects(method) {
		return invoker(ctx, method, req, reply, cc, opts...)
	}
	msg, _ := req.(proto.Message)
	var field protoreflect.FieldDescriptor
	if msg != nil && s.keyField != "" {
		field = msg.ProtoReflect().Descriptor().Fields().ByName(s.keyField)
		if field != nil && (field.Kind() != protoreflect.StringKind || field.Cardinality() == protoreflect.Repeated) {
			field = nil
		}
	}
	if field != nil && msg.ProtoReflect().Get(field).String() != "" {
		return invoker(ctx, method, req, reply, cc, opts...)
	}
	if len(md.Get(retryAttemptMetadata)) > 0 {
		return status.Error(codes.Internal, "idemgrpc: the client interceptor runs beneath a retry interceptor, "+
			"so that each attempt would get a key of its own: chain idemgrpc.NewClientInterceptor() before the retry interceptor")
	}
	key := s.newKey()
	if field != nil {
		withKey := proto.Clone(msg)
		withKey.ProtoReflect().Set(field, protoreflect.ValueOfString(key))
		return invoker(ctx, method, withKey, reply, cc, opts...)
	}
	return invoker(metadata.AppendToOutgoingContext(ctx, s.metadata, key), method, req, reply, cc, opts...)
}
