package idemgrpc

import (
	"strings"

	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"
)

// readOnlyServices are gRPC's own infrastructure services, which change
// nothing but do not say so in their descriptors: health checks, server
// reflection and channelz.
var readOnlyServices = map[string]bool{
	"grpc.health.v1.Health":                    true,
	"grpc.reflection.v1.ServerReflection":      true,
	"grpc.reflection.v1alpha.ServerReflection": true,
	"grpc.channelz.v1.Channelz":                true,
}

// hasNoSideEffects reports whether the method fullMethod
// ("/package.Service/Method") is known to change nothing, so that neither
// interceptor touches its calls: it is a method of one of gRPC's own
// read-only services, or its descriptor, found in protobuf's global
// registry, says option idempotency_level = NO_SIDE_EFFECTS. A method the
// registry does not know is not.
func hasNoSideEffects(fullMethod string) bool {
	service, method, ok := strings.Cut(strings.TrimPrefix(fullMethod, "/"), "/")
	if !ok {
		return false
	}
	if readOnlyServices[service] {
		return true
	}
	d, err := protoregistry.GlobalFiles.FindDescriptorByName(protoreflect.FullName(service))
	if err != nil {
		return false
	}
	sd, ok := d.(protoreflect.ServiceDescriptor)
	if !ok {
		return false
	}
	md := sd.Methods().ByName(protoreflect.Name(method))
	if md == nil {
		return false
	}
	opts, ok := md.Options().(*descriptorpb.MethodOptions)
	return ok && opts.GetIdempotencyLevel() == descriptorpb.MethodOptions_NO_SIDE_EFFECTS
}
